//! The HTTP client towards replicas, `TCP_NODELAY` throughout: forwarded requests go on
//! connections driven by the requests themselves (`link`); small GETs for scraping and
//! discovery use a pooled hyper client. A replica whose endpoint says `h2c` is spoken to with
//! HTTP/2 prior knowledge on both paths, every other one with HTTP/1.1. Also builds upstream requests from client requests
//! (hop-by-hop headers dropped, `Host` rewritten, the body's original bytes).
//!
//! Invariant: an upstream request carries exactly the bytes the client sent as its body; only
//! headers are touched (hop-by-hop removed, `Host`, and vLLM's `X-data-parallel-rank`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::Endpoint;
use crate::link::{LinkBody, LinkError, Links};

/// vLLM's header naming the DP rank that must serve a request.
pub(crate) const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// The upstream client: forwarded requests on connections driven by the requests themselves
/// (`link`), scrapes and other small GETs on a pooled hyper client. One `Arc`: every request
/// takes a clone, and a hyper client's own clone is a handful of them.
#[derive(Clone, Debug)]
pub(crate) struct Upstream(Arc<Clients>);

#[derive(Debug)]
struct Clients {
    client: Client<HttpConnector, Full<Bytes>>,
    /// The same for h2c replicas: HTTP/2 only, with prior knowledge.
    client_h2: Client<HttpConnector, Full<Bytes>>,
    links: Links,
}

impl Upstream {
    pub fn new(connect_timeout: Duration, pool_idle: Duration) -> Self {
        let mut connector = HttpConnector::new();
        // Small SSE chunks must leave at once: Nagle's algorithm with delayed ACKs adds ~40 ms.
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_max_idle_per_host(256)
            .pool_idle_timeout(pool_idle)
            .build(connector.clone());
        let client_h2 = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(pool_idle)
            .http2_only(true)
            .build(connector);
        Upstream(Arc::new(Clients {
            client,
            client_h2,
            links: Links::new(connect_timeout, pool_idle),
        }))
    }

    /// Forwards one request to `endpoint`, running `written` once it is on its way (see
    /// [`Links::send`]; over HTTP/2, before it is handed to the connection).
    pub async fn send(
        &self,
        endpoint: &Endpoint,
        req: Request<Full<Bytes>>,
        written: impl FnOnce(),
    ) -> Result<Response<LinkBody>, LinkError> {
        if endpoint.h2c {
            written();
            self.0.links.send_h2(&endpoint.authority, req).await
        } else {
            self.0.links.send(&endpoint.authority, req, written).await
        }
    }

    /// `GET base + path`, whole body (at most `limit` bytes), within `timeout`.
    pub async fn get(
        &self,
        endpoint: &Endpoint,
        path: &str,
        timeout: Duration,
        limit: usize,
    ) -> Result<(StatusCode, Bytes), GetError> {
        let uri = upstream_uri(endpoint, path)?;
        let req = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .header(header::HOST, endpoint.authority.as_str())
            .body(Full::new(Bytes::new()))
            .map_err(UriError)?;
        let client = if endpoint.h2c {
            &self.0.client_h2
        } else {
            &self.0.client
        };
        let fut = async {
            let resp = client
                .request(req)
                .await
                .map_err(|e| GetError::Request(error_chain(&e)))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), limit)
                .collect()
                .await
                .map_err(|e| GetError::Body(e.to_string()))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| GetError::Timeout(timeout))?
    }
}

/// Why a small GET to a replica failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GetError {
    #[error(transparent)]
    Uri(#[from] UriError),
    /// Connecting or exchanging the request failed (with its sources).
    #[error("{0}")]
    Request(String),
    #[error("{0}")]
    Body(String),
    #[error("no answer within {} ms", .0.as_millis())]
    Timeout(Duration),
}

/// A path that makes no URI with the replica's base URL.
#[derive(Debug, thiserror::Error)]
#[error("bad upstream URI: {0}")]
pub(crate) struct UriError(#[from] http::Error);

/// The upstream URI for a client path-and-query.
pub(crate) fn upstream_uri(endpoint: &Endpoint, path_and_query: &str) -> Result<Uri, UriError> {
    Ok(Uri::builder()
        .scheme("http")
        .authority(endpoint.authority.clone())
        .path_and_query(format!("{}{}", endpoint.prefix, path_and_query))
        .build()?)
}

/// A forwarded request's URI: the client's path and query as parsed already, unless the
/// endpoint's base URL has a path to put in front of it.
fn forwarded_uri(endpoint: &Endpoint, path_and_query: &PathAndQuery) -> Result<Uri, UriError> {
    if !endpoint.prefix.is_empty() {
        return upstream_uri(endpoint, path_and_query.as_str());
    }
    Ok(Uri::builder()
        .scheme("http")
        .authority(endpoint.authority.clone())
        .path_and_query(path_and_query.clone())
        .build()?)
}

/// An error with its sources, for messages (hyper's top-level errors say little).
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// The standard hop-by-hop headers (RFC 9110 §7.6.1) and the two legacy ones.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::PROXY_AUTHENTICATE
        || name == header::PROXY_AUTHORIZATION
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus the ones
/// named in `Connection`.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none (and a header named in `Connection` needs `Connection`): one
    // pass over the few names present instead of a lookup of each name that might be.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    let hop: Vec<HeaderName> = headers
        .keys()
        .filter(|k| is_hop_by_hop(k))
        .cloned()
        .collect();
    for n in named.into_iter().chain(hop) {
        headers.remove(n);
    }
}

/// The upstream request for one attempt: same method, path and end-to-end headers, the
/// original body bytes, HTTP/1.1 (HTTP/2 for an h2c replica).
pub(crate) fn build_request(
    method: &Method,
    path_and_query: &PathAndQuery,
    client_headers: &HeaderMap,
    body: Bytes,
    endpoint: &Endpoint,
    rank: Option<usize>,
) -> Result<Request<Full<Bytes>>, UriError> {
    let uri = forwarded_uri(endpoint, path_and_query)?;
    let mut headers = client_headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    // With a rank the insert below replaces the client's; without, drop it if sent.
    if rank.is_none() && headers.keys().any(|k| k.as_str() == DP_RANK_HEADER) {
        headers.remove(DP_RANK_HEADER);
    }
    headers.insert(header::HOST, endpoint.host.clone());
    if let Some(r) = rank {
        headers.insert(
            HeaderName::from_static(DP_RANK_HEADER),
            HeaderValue::from(r),
        );
    }
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = if endpoint.h2c {
        Version::HTTP_2
    } else {
        Version::HTTP_11
    };
    *req.headers_mut() = headers;
    Ok(req)
}

/// The response head sent to the client: end-to-end headers of the replica's response.
pub(crate) fn response_headers(mut upstream: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut upstream);
    upstream
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let out = response_headers(h.clone());
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(out.contains_key(header::AUTHORIZATION));
        assert!(out.contains_key(header::CONTENT_TYPE));
    }

    /// Each hop-by-hop header goes even alone (no `Connection` to name it); a message with
    /// none keeps all its headers.
    #[test]
    fn each_hop_by_hop_header_is_dropped_alone() {
        for name in [
            "te",
            "trailer",
            "upgrade",
            "transfer-encoding",
            "proxy-authenticate",
            "proxy-authorization",
            "keep-alive",
            "proxy-connection",
            "connection",
        ] {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
            h.insert(HeaderName::from_static(name), HeaderValue::from_static("x"));
            let out = response_headers(h.clone());
            assert_eq!(out.len(), 1, "{name}: {out:?}");
            assert!(out.contains_key(header::ACCEPT), "{name}");
        }
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        h.insert("x-request-id", HeaderValue::from_static("7"));
        assert_eq!(response_headers(h.clone()), h);
    }

    /// The client's rank header never reaches a replica unless the router sets it; `Host`
    /// names the replica; the path and query go as sent, behind the endpoint's prefix.
    #[test]
    fn a_forwarded_request_names_the_replica_and_only_the_routers_rank() {
        let pq = PathAndQuery::from_static("/v1/completions?x=1");
        let mut client = HeaderMap::new();
        client.insert(header::HOST, HeaderValue::from_static("router:80"));
        client.insert(DP_RANK_HEADER, HeaderValue::from_static("3"));
        let plain = Endpoint::parse("http://10.0.0.1:8000").unwrap();
        let req = build_request(&Method::POST, &pq, &client, Bytes::new(), &plain, None).unwrap();
        assert_eq!(req.headers()[header::HOST], "10.0.0.1:8000");
        assert!(!req.headers().contains_key(DP_RANK_HEADER));
        assert_eq!(
            req.uri().to_string(),
            "http://10.0.0.1:8000/v1/completions?x=1"
        );
        let prefixed = Endpoint::parse("http://10.0.0.1:8000/base").unwrap();
        let req = build_request(
            &Method::POST,
            &pq,
            &client,
            Bytes::new(),
            &prefixed,
            Some(1),
        )
        .unwrap();
        assert_eq!(req.headers()[DP_RANK_HEADER], "1");
        assert_eq!(req.headers().get_all(DP_RANK_HEADER).iter().count(), 1);
        assert_eq!(
            req.uri().to_string(),
            "http://10.0.0.1:8000/base/v1/completions?x=1"
        );
    }
}
