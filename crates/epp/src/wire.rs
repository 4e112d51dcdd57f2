//! The endpoint-picker protocol's fields on Envoy's ext_proc messages, read and written in one
//! place: request headers (pseudo-headers apart), the gateway's subset hint and served-endpoint
//! report, and the answers (destination header and `envoy.lb` metadata, streamed bodies,
//! immediate responses). Pure functions over the generated types.
//!
//! Invariants: header names are matched lowercase (Envoy sends them so; HTTP/2 requires it);
//! a header value is its `raw_value` when set, else `value`; values that are not valid HTTP
//! header values are dropped, never a panic; streamed bodies go back in chunks of at most
//! [`CHUNK`] bytes, the last one flagged `end_of_stream`.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as ProtoHeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use http::{HeaderMap, HeaderName, HeaderValue as HttpHeaderValue};

/// Header (and `envoy.lb` metadata key) carrying the picked endpoints.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Header (and `envoy.lb` metadata key) the gateway reports the serving endpoint with.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// Metadata namespace of the destination and served keys.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace of the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint: the endpoints (`ip:port`) the picker may choose from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// A gateway's request to serve the request as another model: the picker routes it as that
/// model and rewrites the body's `model` (it owns the body on its way through).
pub const MODEL_REWRITE: &str = "x-gateway-model-name-rewrite";
/// vLLM's header pinning a data-parallel rank.
pub const DP_RANK: &str = "x-data-parallel-rank";
/// Largest body chunk streamed back (Envoy recommends at most 64 KiB per message).
pub const CHUNK: usize = 64 * 1024;

/// A header block as the gateway sent it.
#[derive(Debug, Default)]
pub struct Head {
    /// `:path` (request) — empty when absent.
    pub path: String,
    /// `:method` (request).
    pub method: String,
    /// `:status` (response), when present and numeric.
    pub status: Option<u16>,
    /// The regular headers.
    pub headers: HeaderMap,
}

/// Reads a header block: pseudo-headers apart, the rest as an [`HeaderMap`].
pub fn head(map: Option<&ProtoHeaderMap>) -> Head {
    let mut out = Head::default();
    for h in map.map(|m| m.headers.as_slice()).unwrap_or_default() {
        let value: &[u8] = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value
        };
        let key = h.key.to_ascii_lowercase();
        match key.as_str() {
            ":path" => out.path = String::from_utf8_lossy(value).into_owned(),
            ":method" => out.method = String::from_utf8_lossy(value).into_owned(),
            ":status" => {
                out.status = std::str::from_utf8(value)
                    .ok()
                    .and_then(|s| s.trim().parse().ok());
            }
            k if k.starts_with(':') => {}
            _ => {
                if let (Ok(name), Ok(v)) = (
                    HeaderName::from_bytes(key.as_bytes()),
                    HttpHeaderValue::from_bytes(value),
                ) {
                    out.headers.append(name, v);
                }
            }
        }
    }
    out
}

/// The strings of a metadata value: a list of strings, or one string of comma-separated
/// entries.
fn strings(v: &Value) -> Vec<String> {
    match &v.kind {
        Some(Kind::StringValue(s)) => split_list(s),
        Some(Kind::ListValue(l)) => l
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                _ => None,
            })
            .filter(|s| !s.is_empty())
            .collect(),
        _ => Vec::new(),
    }
}

/// `a, b,c` → `["a", "b", "c"]`.
pub fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

fn metadata_value<'m>(md: Option<&'m Metadata>, namespace: &str, key: &str) -> Option<&'m Value> {
    md?.filter_metadata.get(namespace)?.fields.get(key)
}

/// The gateway's subset hint, when it sent one.
pub fn subset_hint(md: Option<&Metadata>) -> Option<Vec<String>> {
    metadata_value(md, SUBSET_NAMESPACE, SUBSET_KEY).map(strings)
}

/// The endpoint the gateway says served the response: the metadata key, else the header.
pub fn served(md: Option<&Metadata>, headers: &HeaderMap) -> Option<String> {
    let from_md = metadata_value(md, LB_NAMESPACE, SERVED)
        .map(strings)
        .and_then(|v| v.into_iter().next());
    from_md.or_else(|| {
        headers
            .get(SERVED)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| split_list(s).into_iter().next())
    })
}

fn set_header(key: &str, value: String) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.into_bytes(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

/// The picker's answer: the destination header (and a DP rank when pinned), with the route
/// cache cleared so that the gateway routes on them.
pub fn destination_common(endpoints: &[String], dp_rank: Option<usize>) -> CommonResponse {
    let mut set_headers = vec![set_header(DESTINATION, endpoints.join(","))];
    if let Some(rank) = dp_rank {
        set_headers.push(set_header(DP_RANK, rank.to_string()));
    }
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            ..HeaderMutation::default()
        }),
        clear_route_cache: true,
        ..CommonResponse::default()
    }
}

/// `body` with its top-level `model` set to `model`; `None` when the body is not a JSON object.
pub fn rewrite_model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?.insert(
        "model".to_owned(),
        serde_json::Value::String(model.to_owned()),
    );
    serde_json::to_vec(&v).ok()
}

/// Adds to a destination answer what a rewritten body needs: its new length, and the rewrite
/// header removed (it was for the picker).
pub fn rewritten(common: &mut CommonResponse, len: usize) {
    let m = common
        .header_mutation
        .get_or_insert_with(HeaderMutation::default);
    m.set_headers
        .push(set_header("content-length", len.to_string()));
    m.remove_headers.push(MODEL_REWRITE.to_owned());
}

/// The whole body replaced (buffered and streamed modes).
pub fn replace_body(common: &mut CommonResponse, body: Vec<u8>) {
    common.body_mutation = Some(BodyMutation {
        mutation: Some(body_mutation::Mutation::Body(body)),
    });
}

/// `envoy.lb` / `x-gateway-destination-endpoint`: the ordered endpoint list.
pub fn destination_metadata(endpoints: &[String]) -> Struct {
    let list = Value {
        kind: Some(Kind::StringValue(endpoints.join(","))),
    };
    let lb = Struct {
        fields: HashMap::from([(DESTINATION.to_owned(), list)]),
    };
    Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        )]),
    }
}

/// A list value of strings (for tests and gateways building a subset hint).
pub fn string_list(items: &[String]) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue(s.clone())),
                })
                .collect(),
        })),
    }
}

fn response(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..ProcessingResponse::default()
    }
}

/// A request-headers answer (`common`: none means continue unchanged).
pub fn request_headers(common: Option<CommonResponse>) -> ProcessingResponse {
    response(processing_response::Response::RequestHeaders(
        HeadersResponse { response: common },
    ))
}

/// A response-headers answer that continues unchanged.
pub fn response_headers() -> ProcessingResponse {
    response(processing_response::Response::ResponseHeaders(
        HeadersResponse::default(),
    ))
}

/// A request-trailers answer that continues unchanged.
pub fn request_trailers() -> ProcessingResponse {
    response(processing_response::Response::RequestTrailers(
        TrailersResponse::default(),
    ))
}

/// A response-trailers answer that continues unchanged.
pub fn response_trailers() -> ProcessingResponse {
    response(processing_response::Response::ResponseTrailers(
        TrailersResponse::default(),
    ))
}

/// A request-body answer (`common`: none means continue unchanged).
pub fn request_body(common: Option<CommonResponse>) -> ProcessingResponse {
    response(processing_response::Response::RequestBody(BodyResponse {
        response: common,
    }))
}

/// A response-body answer that continues unchanged (streamed and buffered modes).
pub fn response_body() -> ProcessingResponse {
    response(processing_response::Response::ResponseBody(
        BodyResponse::default(),
    ))
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                },
            )),
        }),
        ..CommonResponse::default()
    }
}

/// A whole request body streamed back (full-duplex mode), in chunks of at most [`CHUNK`].
pub fn request_body_streamed(body: &[u8]) -> Vec<ProcessingResponse> {
    if body.is_empty() {
        return vec![request_body(Some(streamed(Vec::new(), true)))];
    }
    let n = body.len().div_ceil(CHUNK);
    body.chunks(CHUNK)
        .enumerate()
        .map(|(i, c)| request_body(Some(streamed(c.to_vec(), i + 1 == n))))
        .collect()
}

/// One response-body chunk streamed back unchanged (full-duplex mode).
pub fn response_body_streamed(chunk: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    response(processing_response::Response::ResponseBody(BodyResponse {
        response: Some(streamed(chunk, end_of_stream)),
    }))
}

/// A response the gateway sends at once instead of forwarding (the router's own error).
pub fn immediate(
    status: u16,
    body: Vec<u8>,
    retry_after_s: Option<u32>,
    details: &str,
) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "application/json".to_owned())];
    if let Some(s) = retry_after_s {
        set_headers.push(set_header("retry-after", s.to_string()));
    }
    response(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                ..HeaderMutation::default()
            }),
            body,
            details: details.to_owned(),
            ..ImmediateResponse::default()
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(key: &str, value: &str, raw: bool) -> HeaderValue {
        HeaderValue {
            key: key.to_owned(),
            value: if raw { String::new() } else { value.to_owned() },
            raw_value: if raw {
                value.as_bytes().to_vec()
            } else {
                Vec::new()
            },
        }
    }

    #[test]
    fn a_header_block_splits_pseudo_headers_and_prefers_raw_values() {
        let map = ProtoHeaderMap {
            headers: vec![
                hv(":path", "/v1/chat/completions", true),
                hv(":method", "POST", false),
                hv(":authority", "gw", true),
                hv("Content-Type", "application/json", true),
                hv("x-bad", "a\nb", true),
                hv(":status", "503", false),
            ],
        };
        let h = head(Some(&map));
        assert_eq!(h.path, "/v1/chat/completions");
        assert_eq!(h.method, "POST");
        assert_eq!(h.status, Some(503));
        assert_eq!(h.headers.len(), 1, "{:?}", h.headers);
        assert_eq!(h.headers["content-type"], "application/json");
    }

    #[test]
    fn subset_and_served_read_lists_and_strings() {
        let mut md = Metadata::default();
        md.filter_metadata.insert(
            SUBSET_NAMESPACE.to_owned(),
            Struct {
                fields: HashMap::from([(
                    SUBSET_KEY.to_owned(),
                    string_list(&["10.0.0.1:8000".to_owned(), " 10.0.0.2:8000".to_owned()]),
                )]),
            },
        );
        assert_eq!(
            subset_hint(Some(&md)),
            Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()])
        );
        assert_eq!(subset_hint(None), None);
        let mut headers = HeaderMap::new();
        headers.insert(SERVED, HttpHeaderValue::from_static("10.0.0.9:1"));
        assert_eq!(served(None, &headers).as_deref(), Some("10.0.0.9:1"));
        md.filter_metadata.insert(
            LB_NAMESPACE.to_owned(),
            Struct {
                fields: HashMap::from([(
                    SERVED.to_owned(),
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.2:8000".to_owned())),
                    },
                )]),
            },
        );
        assert_eq!(
            served(Some(&md), &headers).as_deref(),
            Some("10.0.0.2:8000")
        );
    }

    #[test]
    fn a_streamed_body_is_chunked_with_end_of_stream_on_the_last() {
        let body = vec![7u8; CHUNK * 2 + 1];
        let out = request_body_streamed(&body);
        assert_eq!(out.len(), 3);
        let mut back = Vec::new();
        for (i, r) in out.iter().enumerate() {
            let Some(processing_response::Response::RequestBody(BodyResponse {
                response: Some(c),
            })) = &r.response
            else {
                panic!("not a body response: {r:?}");
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) =
                c.body_mutation.as_ref().and_then(|m| m.mutation.as_ref())
            else {
                panic!("not streamed: {c:?}");
            };
            assert_eq!(s.end_of_stream, i == 2);
            back.extend_from_slice(&s.body);
        }
        assert_eq!(back, body);
        assert_eq!(request_body_streamed(&[]).len(), 1);
    }

    #[test]
    fn a_model_rewrite_changes_only_the_model() {
        let out = rewrite_model(br#"{"model":"a","prompt":"hi","n":2}"#, "b").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v, serde_json::json!({"model": "b", "prompt": "hi", "n": 2}));
        assert_eq!(rewrite_model(b"[1,2]", "b"), None);
        assert_eq!(rewrite_model(b"{oops", "b"), None);
    }

    #[test]
    fn the_destination_is_a_header_and_lb_metadata() {
        let eps = ["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()];
        let c = destination_common(&eps, Some(1));
        let set = &c.header_mutation.as_ref().map(|m| m.set_headers.clone());
        let set = set.as_ref().map(Vec::as_slice).unwrap_or_default();
        let got: Vec<(String, Vec<u8>)> = set
            .iter()
            .filter_map(|o| o.header.as_ref())
            .map(|h| (h.key.clone(), h.raw_value.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    DESTINATION.to_owned(),
                    b"10.0.0.1:8000,10.0.0.2:8000".to_vec()
                ),
                (DP_RANK.to_owned(), b"1".to_vec())
            ]
        );
        assert!(c.clear_route_cache);
        let md = destination_metadata(&eps);
        let Some(Kind::StructValue(lb)) = md.fields.get(LB_NAMESPACE).and_then(|v| v.kind.clone())
        else {
            panic!("no envoy.lb: {md:?}");
        };
        assert_eq!(lb.fields.get(DESTINATION).map(strings), Some(eps.to_vec()));
    }
}
