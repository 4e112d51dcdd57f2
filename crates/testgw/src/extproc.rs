//! ext_proc message building and reading: header maps as Envoy sends them (lower-case keys,
//! values in `raw_value`, pseudo headers first), header mutations as Envoy applies them, and the
//! GIE metadata keys. Invariant: header lists keep their order and may repeat a key.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{HeaderMutation, ProtocolConfiguration};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

use crate::config::{RequestBodyMode, ResponseBodyMode};

/// Header carrying the picker's choice, and the dynamic-metadata key of the same name.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Header and metadata key the gateway reports the endpoint that served on.
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Dynamic-metadata namespace of the destination and the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Filter-metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint list.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Request header a test uses to give one request its own subset hint (`ip:port,ip:port`).
pub const TEST_SUBSET_HEADER: &str = "x-test-subset";

/// Headers in wire order, pseudo headers included; keys lower-case.
pub(crate) type HeaderList = Vec<(String, Vec<u8>)>;

pub(crate) fn header_map(list: &HeaderList) -> HeaderMap {
    HeaderMap {
        headers: list
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.clone(),
                value: String::new(),
                raw_value: v.clone(),
            })
            .collect(),
    }
}

pub(crate) fn get<'a>(list: &'a HeaderList, key: &str) -> Option<&'a [u8]> {
    list.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(key))
        .map(|(_, v)| v.as_slice())
}

fn header_value(h: &HeaderValue) -> Vec<u8> {
    // Envoy sends and reads `raw_value`; older processors fill `value` only.
    if h.raw_value.is_empty() {
        h.value.as_bytes().to_vec()
    } else {
        h.raw_value.clone()
    }
}

/// Applies a mutation the way Envoy's ext_proc filter does: removals first, then each set
/// header by its append action (the deprecated `append` flag wins when present). Pseudo headers
/// are always overwritten and never removed.
pub(crate) fn apply_mutation(list: &mut HeaderList, m: &HeaderMutation) {
    for key in &m.remove_headers {
        if !key.starts_with(':') {
            list.retain(|(k, _)| !k.eq_ignore_ascii_case(key));
        }
    }
    for opt in &m.set_headers {
        let Some(h) = &opt.header else { continue };
        let key = h.key.to_ascii_lowercase();
        let value = header_value(h);
        if value.is_empty() && !opt.keep_empty_value {
            list.retain(|(k, _)| *k != key);
            continue;
        }
        #[allow(deprecated)]
        let action = match &opt.append {
            Some(append) if append.value => HeaderAppendAction::AppendIfExistsOrAdd,
            Some(_) => HeaderAppendAction::OverwriteIfExistsOrAdd,
            None => HeaderAppendAction::try_from(opt.append_action)
                .unwrap_or(HeaderAppendAction::AppendIfExistsOrAdd),
        };
        let exists = list.iter().any(|(k, _)| *k == key);
        let action = if key.starts_with(':') {
            HeaderAppendAction::OverwriteIfExistsOrAdd
        } else {
            action
        };
        match action {
            HeaderAppendAction::AppendIfExistsOrAdd => list.push((key, value)),
            HeaderAppendAction::AddIfAbsent => {
                if !exists {
                    list.push((key, value));
                }
            }
            HeaderAppendAction::OverwriteIfExistsOrAdd | HeaderAppendAction::OverwriteIfExists => {
                if exists {
                    // Overwrite in place so a pseudo header keeps its leading position.
                    let mut first = true;
                    list.retain_mut(|(k, v)| {
                        if *k != key {
                            return true;
                        }
                        if first {
                            first = false;
                            *v = value.clone();
                            return true;
                        }
                        false
                    });
                } else if action == HeaderAppendAction::OverwriteIfExistsOrAdd {
                    list.push((key, value));
                }
            }
        }
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// Filter metadata `{namespace: {key: value}}`.
pub(crate) fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
    let mut fields = std::collections::HashMap::new();
    fields.insert(key.to_owned(), value);
    let mut filter_metadata = std::collections::HashMap::new();
    filter_metadata.insert(namespace.to_owned(), Struct { fields });
    Metadata {
        filter_metadata,
        ..Default::default()
    }
}

pub(crate) fn subset_metadata(subset: &[String]) -> Metadata {
    let list = ListValue {
        values: subset.iter().map(|s| string_value(s)).collect(),
    };
    metadata(
        SUBSET_NAMESPACE,
        SUBSET_KEY,
        Value {
            kind: Some(Kind::ListValue(list)),
        },
    )
}

pub(crate) fn served_metadata(endpoint: &str) -> Metadata {
    metadata(LB_NAMESPACE, SERVED_HEADER, string_value(endpoint))
}

/// The destination list in dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`:
/// a comma-separated string as GIE specifies, or a list of strings.
pub(crate) fn destination_from_metadata(md: &Struct) -> Option<Vec<String>> {
    let Some(Value {
        kind: Some(Kind::StructValue(lb)),
    }) = md.fields.get(LB_NAMESPACE)
    else {
        return None;
    };
    match lb.fields.get(DESTINATION_HEADER)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(split_list(s)),
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                    _ => None,
                })
                .filter(|s| !s.is_empty())
                .collect(),
        ),
        _ => None,
    }
}

pub(crate) fn destination_from_mutation(m: &HeaderMutation) -> Option<Vec<String>> {
    m.set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key.eq_ignore_ascii_case(DESTINATION_HEADER))
        .map(|h| split_list(&String::from_utf8_lossy(&header_value(h))))
}

pub(crate) fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

pub(crate) fn protocol_config(
    request: RequestBodyMode,
    response: ResponseBodyMode,
    without_waiting: bool,
) -> ProtocolConfiguration {
    let request_body_mode = match request {
        RequestBodyMode::FullDuplexStreamed => BodySendMode::FullDuplexStreamed,
        RequestBodyMode::Buffered => BodySendMode::Buffered,
    };
    let response_body_mode = match response {
        ResponseBodyMode::None => BodySendMode::None,
        ResponseBodyMode::Streamed => BodySendMode::Streamed,
        ResponseBodyMode::FullDuplexStreamed => BodySendMode::FullDuplexStreamed,
    };
    ProtocolConfiguration {
        request_body_mode: request_body_mode as i32,
        response_body_mode: response_body_mode as i32,
        send_body_without_waiting_for_header_response: without_waiting
            || request == RequestBodyMode::FullDuplexStreamed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;

    fn set(key: &str, value: &str, action: HeaderAppendAction) -> HeaderValueOption {
        HeaderValueOption {
            header: Some(HeaderValue {
                key: key.into(),
                value: String::new(),
                raw_value: value.as_bytes().to_vec(),
            }),
            append_action: action as i32,
            ..Default::default()
        }
    }

    #[test]
    fn mutations_follow_append_actions() {
        let mut list: HeaderList = vec![
            (":path".into(), b"/a".to_vec()),
            ("x-a".into(), b"1".to_vec()),
            ("x-b".into(), b"2".to_vec()),
            ("x-gone".into(), b"3".to_vec()),
        ];
        let m = HeaderMutation {
            set_headers: vec![
                set("x-a", "10", HeaderAppendAction::AppendIfExistsOrAdd),
                set("x-b", "20", HeaderAppendAction::OverwriteIfExistsOrAdd),
                set("x-c", "30", HeaderAppendAction::OverwriteIfExists),
                set("x-b", "99", HeaderAppendAction::AddIfAbsent),
                set(":path", "/b", HeaderAppendAction::AppendIfExistsOrAdd),
            ],
            remove_headers: vec!["X-Gone".into(), ":path".into()],
        };
        apply_mutation(&mut list, &m);
        assert_eq!(
            list,
            vec![
                (":path".to_string(), b"/b".to_vec()),
                ("x-a".to_string(), b"1".to_vec()),
                ("x-b".to_string(), b"20".to_vec()),
                ("x-a".to_string(), b"10".to_vec()),
            ]
        );
    }

    #[test]
    fn destinations_read_from_string_or_list_metadata_and_header() {
        let mut lb = Struct::default();
        lb.fields.insert(
            DESTINATION_HEADER.into(),
            string_value("1.1.1.1:80, 2.2.2.2:80"),
        );
        let mut md = Struct::default();
        md.fields.insert(
            LB_NAMESPACE.into(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        );
        assert_eq!(
            destination_from_metadata(&md),
            Some(vec!["1.1.1.1:80".to_string(), "2.2.2.2:80".to_string()])
        );
        let m = HeaderMutation {
            set_headers: vec![set(
                "X-Gateway-Destination-Endpoint",
                "3.3.3.3:80",
                HeaderAppendAction::AppendIfExistsOrAdd,
            )],
            remove_headers: vec![],
        };
        assert_eq!(
            destination_from_mutation(&m),
            Some(vec!["3.3.3.3:80".to_string()])
        );
        assert_eq!(destination_from_metadata(&Struct::default()), None);
    }
}
