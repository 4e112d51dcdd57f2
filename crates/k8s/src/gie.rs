//! The Gateway API Inference Extension's `InferencePool` (`inference.networking.k8s.io/v1`) as
//! a typed resource: the fields a router reads (selector, target ports, app protocol), the rest
//! kept loosely.
//!
//! A typed `CustomResource` rather than a `DynamicObject`: the selector and ports are read on
//! every change, and a typed spec turns a malformed pool into one deserialisation error in the
//! watch instead of `serde_json::Value` probing scattered through the discovery code. Unknown
//! fields are ignored, so newer pool versions with more fields still parse. The CRD itself is
//! upstream's; `InferencePool::crd()` (from the derive) is schema-compatible for what is read
//! here and is what the tests install into a bare API server.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `InferencePool.spec`.
#[derive(CustomResource, Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "infpool",
    namespaced,
    status = "InferencePoolStatus",
    // `*.k8s.io` groups are protected: the API server refuses their CRDs without it. Upstream's
    // value, so `InferencePool::crd()` is installable like upstream's file.
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Which pods of the pool's namespace are its members (labels only, like a Service's).
    pub selector: PoolSelector,
    /// The ports the model servers listen on (1 to 8).
    #[serde(default)]
    pub target_ports: Vec<TargetPort>,
    /// `http` (the default) or `kubernetes.io/h2c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    /// The endpoint picker gateways call; kinference does not read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// `spec.selector`: equality on labels.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One of `spec.targetPorts`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct TargetPort {
    pub number: u16,
}

/// `spec.endpointPickerRef`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default)]
    pub name: String,
    /// `{number}`, as in `targetPorts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<TargetPort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

/// `InferencePool.status`, written by gateways; kept opaque.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct InferencePoolStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "opaque_list")]
    pub parents: Vec<serde_json::Value>,
}

fn opaque_list(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_v1_endpoint_picker_ref_keeps_its_port() {
        let spec: InferencePoolSpec = serde_json::from_value(serde_json::json!({
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"kind": "Service", "name": "epp", "port": {"number": 9002},
                                  "failureMode": "FailOpen"}
        }))
        .unwrap();
        let epp = spec.endpoint_picker_ref.unwrap();
        assert_eq!(epp.port, Some(TargetPort { number: 9002 }));
        assert_eq!(epp.failure_mode.as_deref(), Some("FailOpen"));
    }
}
