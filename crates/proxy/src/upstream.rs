//! The HTTP client towards replicas, `TCP_NODELAY` throughout: forwarded requests go on
//! connections driven by the requests themselves (`link`); small GETs for scraping and
//! discovery use a pooled hyper client. A replica whose endpoint says `h2c` is spoken to with
//! HTTP/2 prior knowledge on both paths, every other one with HTTP/1.1. Also what of a client's
//! request reaches a replica, and what of a replica's response head reaches the client: the
//! end-to-end headers (hop-by-hop ones, and those `Connection` names, dropped), `Host`
//! rewritten, the body's original bytes.
//!
//! Over HTTP/1.1 neither direction builds a header map (see `heads` for why): a request's head
//! is written straight from the client's headers ([`write_head`]), and a response's headers go
//! to the client as the bytes the replica sent ([`client_headers`]). HTTP/2 replicas get the
//! same headers in a request built for hyper ([`build_request`]), through the same filter
//! ([`forwarded`]).
//!
//! Invariant: an upstream request carries exactly the bytes the client sent as its body; only
//! headers are touched (hop-by-hop removed, `Host`, and vLLM's `X-data-parallel-rank`).

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::Endpoint;
use crate::heads::{Headers, WireHeaders};
use crate::link::{LinkError, Links, Reply};
use crate::sock;

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
        req: &Outgoing<'_>,
        written: impl FnOnce(),
    ) -> Result<Reply, SendError> {
        let links = &self.0.links;
        if endpoint.h2c {
            let built = build_request(req, endpoint)?;
            written();
            return Ok(links.send_h2(&endpoint.authority, built).await?);
        }
        let head_only = req.method == Method::HEAD;
        let head = |out: &mut Vec<u8>| write_head(out, req, endpoint);
        Ok(links
            .send(&endpoint.authority, head_only, head, req.body, written)
            .await?)
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

/// Why a forwarded request got no response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// The path makes no URI with the replica's base URL (HTTP/2 only): nothing was sent.
    #[error(transparent)]
    Uri(#[from] UriError),
    #[error(transparent)]
    Link(#[from] LinkError),
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

/// Whether `name` (in any case) is a standard hop-by-hop header (RFC 9110 §7.6.1) or one of
/// the two legacy ones. By length first: most names are none of them.
fn is_hop_by_hop(name: &[u8]) -> bool {
    let is = |s: &str| name.eq_ignore_ascii_case(s.as_bytes());
    match name.len() {
        2 => is("te"),
        7 => is("trailer") || is("upgrade"),
        10 => is("connection") || is("keep-alive"),
        16 => is("proxy-connection"),
        17 => is("transfer-encoding"),
        18 => is("proxy-authenticate"),
        19 => is("proxy-authorization"),
        _ => false,
    }
}

/// The header names a message's `Connection` headers list: they describe the connection too
/// (RFC 9110 §7.6.1). Empty, and nothing allocated, for a message without `Connection`.
#[derive(Default)]
struct Named<'a>(Vec<&'a [u8]>);

impl<'a> Named<'a> {
    fn of(headers: &'a Headers) -> Self {
        let connection = |(n, _): &(&[u8], &[u8])| n.eq_ignore_ascii_case(b"connection");
        if !headers.iter().any(|h| connection(&h)) {
            return Named::default();
        }
        Named(
            headers
                .iter()
                .filter(connection)
                .flat_map(|(_, v)| v.split(|&b| b == b','))
                .map(<[u8]>::trim_ascii)
                .filter(|n| !n.is_empty())
                .collect(),
        )
    }

    /// Whether `name` is end-to-end: neither hop-by-hop nor listed.
    fn end_to_end(&self, name: &[u8]) -> bool {
        !is_hop_by_hop(name) && !self.0.iter().any(|n| n.eq_ignore_ascii_case(name))
    }
}

/// Whether a client's header goes on to the replica: end-to-end, and none of those the router
/// sets itself (`Host`, `Content-Length`, vLLM's rank).
fn forwarded(name: &[u8], named: &Named<'_>) -> bool {
    !name.eq_ignore_ascii_case(b"host")
        && !name.eq_ignore_ascii_case(b"content-length")
        && !name.eq_ignore_ascii_case(DP_RANK_HEADER.as_bytes())
        && named.end_to_end(name)
}

/// A request as it goes to a replica: the client's method, path and query and headers (only
/// the end-to-end ones are sent), the original body, and the DP rank to pin it to.
#[derive(Debug)]
pub(crate) struct Outgoing<'a> {
    pub method: &'a Method,
    pub path_and_query: &'a PathAndQuery,
    pub headers: &'a Headers,
    pub body: &'a Bytes,
    pub rank: Option<usize>,
}

/// Writes the HTTP/1.1 head of `req` for `endpoint` (request line in origin form, `Host`, the
/// forwarded headers, the rank, `Content-Length`, the blank line): straight from the client's
/// headers, with no request or header map built for it.
fn write_head(out: &mut Vec<u8>, req: &Outgoing<'_>, endpoint: &Endpoint) {
    out.extend_from_slice(req.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(endpoint.prefix.as_bytes());
    out.extend_from_slice(req.path_and_query.as_str().as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(endpoint.host.as_bytes());
    out.extend_from_slice(b"\r\n");
    let named = Named::of(req.headers);
    for (name, value) in req.headers.iter() {
        if forwarded(name, &named) {
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
    }
    if let Some(r) = req.rank {
        // Into the buffer itself: a Vec's io::Write cannot fail.
        let _ = write!(out, "{DP_RANK_HEADER}: {r}\r\n");
    }
    let bodiless = matches!(
        *req.method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    );
    if !req.body.is_empty() || !bodiless {
        let _ = write!(out, "content-length: {}\r\n", req.body.len());
    }
    out.extend_from_slice(b"\r\n");
}

/// The upstream request for an HTTP/2 replica: the same method, path, forwarded headers, rank
/// and body as [`write_head`] writes for HTTP/1.1 (hyper sets `Content-Length` from the body).
pub(crate) fn build_request(
    req: &Outgoing<'_>,
    endpoint: &Endpoint,
) -> Result<Request<Full<Bytes>>, UriError> {
    let uri = forwarded_uri(endpoint, req.path_and_query)?;
    let named = Named::of(req.headers);
    let mut headers = HeaderMap::with_capacity(req.headers.count() + 2);
    headers.insert(header::HOST, endpoint.host.clone());
    for (name, value) in req.headers.iter() {
        // Each is valid (checked by whichever parser read the client's head).
        if let (true, Ok(n), Ok(v)) = (
            forwarded(name, &named),
            HeaderName::from_bytes(name),
            HeaderValue::from_bytes(value),
        ) {
            headers.append(n, v);
        }
    }
    if let Some(r) = req.rank {
        headers.insert(
            HeaderName::from_static(DP_RANK_HEADER),
            HeaderValue::from(r),
        );
    }
    let mut built = Request::new(Full::new(req.body.clone()));
    *built.method_mut() = req.method.clone();
    *built.uri_mut() = uri;
    *built.version_mut() = if endpoint.h2c {
        Version::HTTP_2
    } else {
        Version::HTTP_11
    };
    *built.headers_mut() = headers;
    Ok(built)
}

/// A replica's response headers as the client gets them: the end-to-end ones (hop-by-hop
/// headers, and those `Connection` names, left out) in wire form with `Content-Length` read
/// apart, then `extra`, the router's own (a replica's header of the same name is left out).
/// Also whether the response is an event stream of unknown length (a failure after its head
/// can still be told as an SSE event).
pub(crate) fn client_headers(reply: &Headers, extra: &[(&str, &[u8])]) -> (WireHeaders, bool) {
    let is = |name: &[u8], s: &str| name.eq_ignore_ascii_case(s.as_bytes());
    let named = Named::of(reply);
    let mut wire = WireHeaders::with_capacity(reply.wire_len() + 64);
    let mut event_stream = false;
    for (name, value) in reply.iter() {
        if !named.end_to_end(name) || extra.iter().any(|(n, _)| is(name, n)) {
            continue;
        }
        if is(name, "content-length") {
            wire.content_length = sock::content_length(value);
            continue;
        }
        event_stream |= is(name, "content-type") && value.starts_with(b"text/event-stream");
        wire.dated |= is(name, "date");
        wire.push(name, value);
    }
    for (name, value) in extra {
        wire.push(name.as_bytes(), value);
    }
    let sse = event_stream && wire.content_length.is_none();
    (wire, sse)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn raw(lines: &[&str]) -> Headers {
        Headers::from_lines(lines)
    }

    /// The same headers in hyper's map (an HTTP/2 replica's).
    fn map(lines: &[&str]) -> Headers {
        let mut m = HeaderMap::new();
        for line in lines {
            let (name, value) = line.split_once(": ").unwrap();
            m.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        Headers::Map(m)
    }

    fn lines(w: &WireHeaders) -> String {
        String::from_utf8(w.lines.clone()).unwrap()
    }

    /// Hop-by-hop headers, and those `Connection` names (in any case), stay behind; the rest
    /// go in order, in both forms of a replica's headers.
    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let sent = [
            "Connection: keep-alive, X-Private",
            "x-private: 1",
            "Keep-Alive: timeout=5",
            "Transfer-Encoding: chunked",
            "Authorization: Bearer k",
            "Content-Type: application/json",
        ];
        let (w, sse) = client_headers(&raw(&sent), &[]);
        assert_eq!(
            lines(&w),
            "Authorization: Bearer k\r\nContent-Type: application/json\r\n"
        );
        assert!(!sse);
        let (w, _) = client_headers(&map(&sent), &[]);
        assert_eq!(
            lines(&w),
            "authorization: Bearer k\r\ncontent-type: application/json\r\n"
        );
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
            "Proxy-Authorization",
            "keep-alive",
            "proxy-connection",
            "CONNECTION",
        ] {
            let (w, _) = client_headers(&raw(&["accept: */*", &format!("{name}: x")]), &[]);
            assert_eq!(lines(&w), "accept: */*\r\n", "{name}");
        }
        let (w, _) = client_headers(&raw(&["accept: */*", "x-request-id: 7"]), &[]);
        assert_eq!(lines(&w), "accept: */*\r\nx-request-id: 7\r\n");
    }

    /// `Content-Length` is read apart (the writer frames the body); an event stream is one
    /// only without a length; a `Date` is noted; the router's own headers replace a
    /// replica's of the same name.
    #[test]
    fn the_length_the_stream_and_the_routers_headers() {
        let (w, sse) = client_headers(
            &raw(&[
                "content-type: text/event-stream; charset=utf-8",
                "date: Mon, 07 Dec 2026 12:00:00 GMT",
                "x-kinference-endpoint: spoofed",
            ]),
            &[("x-kinference-endpoint", b"10.0.0.1:8000")],
        );
        assert!(sse);
        assert!(w.dated);
        assert_eq!(w.content_length, None);
        assert_eq!(
            lines(&w),
            "content-type: text/event-stream; charset=utf-8\r\n\
             date: Mon, 07 Dec 2026 12:00:00 GMT\r\nx-kinference-endpoint: 10.0.0.1:8000\r\n"
        );
        let (w, sse) = client_headers(
            &map(&["content-type: text/event-stream", "content-length: 12"]),
            &[],
        );
        assert!(!sse);
        assert!(!w.dated);
        assert_eq!(w.content_length, Some(12));
        assert_eq!(lines(&w), "content-type: text/event-stream\r\n");
    }

    /// What a replica gets of a client's request, from either form of its headers (the data
    /// port's raw head, names as sent; hyper's map) and in both forms of the request (the
    /// HTTP/1.1 head written for it, the HTTP/2 request built for it): `Host` names the
    /// replica; the client's rank header never goes, the router's does when it pins one;
    /// hop-by-hop headers, and those `Connection` names, stay behind; `Content-Length` is the
    /// body's; every other header goes with all its values; the path and query go as sent,
    /// behind the endpoint's prefix.
    #[test]
    fn a_forwarded_request_names_the_replica_and_only_the_routers_rank() {
        let pq = PathAndQuery::from_static("/v1/completions?x=1");
        let sent = [
            "Host: router:80",
            "X-Data-Parallel-Rank: 3",
            "Connection: keep-alive, X-Private",
            "x-private: 1",
            "Keep-Alive: timeout=5",
            "TE: trailers",
            "Content-Length: 99",
            "Authorization: Bearer k",
            "x-multi: a",
            "x-multi: b",
        ];
        let plain = Endpoint::parse("http://10.0.0.1:8000").unwrap();
        let prefixed = Endpoint::parse("http://10.0.0.1:8000/base").unwrap();
        let body = Bytes::from_static(b"{}");
        for (client, auth) in [(raw(&sent), "Authorization"), (map(&sent), "authorization")] {
            let req = |method, rank| Outgoing {
                method,
                path_and_query: &pq,
                headers: &client,
                body: &body,
                rank,
            };
            let h1 = |req: &Outgoing<'_>, endpoint: &Endpoint| {
                let mut out = Vec::new();
                write_head(&mut out, req, endpoint);
                String::from_utf8(out).unwrap()
            };
            let end_to_end = format!("{auth}: Bearer k\r\nx-multi: a\r\nx-multi: b\r\n");

            let post = req(&Method::POST, None);
            assert_eq!(
                h1(&post, &plain),
                format!(
                    "POST /v1/completions?x=1 HTTP/1.1\r\nhost: 10.0.0.1:8000\r\n{end_to_end}\
                     content-length: 2\r\n\r\n"
                )
            );
            let built = build_request(&post, &plain).unwrap();
            assert_eq!(
                built.uri().to_string(),
                "http://10.0.0.1:8000/v1/completions?x=1"
            );
            let names: Vec<&str> = built.headers().keys().map(|k| k.as_str()).collect();
            assert_eq!(names, ["host", "authorization", "x-multi"]);
            assert_eq!(built.headers()[header::HOST], "10.0.0.1:8000");
            let multi: Vec<_> = built.headers().get_all("x-multi").iter().collect();
            assert_eq!(multi, ["a", "b"]);

            let pinned = req(&Method::POST, Some(1));
            assert_eq!(
                h1(&pinned, &prefixed),
                format!(
                    "POST /base/v1/completions?x=1 HTTP/1.1\r\nhost: 10.0.0.1:8000\r\n\
                     {end_to_end}{DP_RANK_HEADER}: 1\r\ncontent-length: 2\r\n\r\n"
                )
            );
            let built = build_request(&pinned, &prefixed).unwrap();
            assert_eq!(
                built.uri().to_string(),
                "http://10.0.0.1:8000/base/v1/completions?x=1"
            );
            let ranks: Vec<_> = built.headers().get_all(DP_RANK_HEADER).iter().collect();
            assert_eq!(ranks, ["1"]);

            // A bodiless GET says no length.
            let get = Outgoing {
                body: &Bytes::new(),
                ..req(&Method::GET, None)
            };
            assert_eq!(
                h1(&get, &plain),
                format!(
                    "GET /v1/completions?x=1 HTTP/1.1\r\nhost: 10.0.0.1:8000\r\n{end_to_end}\r\n"
                )
            );
        }
    }
}
