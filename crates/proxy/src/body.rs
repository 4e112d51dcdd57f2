//! Reading a client's request: the whole body within the configured size and time, and the
//! target path as forwarded. Shared by both ports.
//!
//! Invariants: a body over the limit is refused (413) before or while it is read, never
//! buffered beyond the limit. A body that trickles is cut (408) once it is later than
//! `timeouts.body_read_ms` plus the time `limits.min_body_rate_bytes_per_s` allows for what
//! has arrived; a body that is already there costs no timer.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::uri::PathAndQuery;
use http::Uri;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;

use crate::error::RequestError;
use crate::fleet::Fleet;

/// Reads a whole request body within the fleet's size and time limits; a body cut for its
/// slowness is counted under `port`.
pub(crate) async fn read_body<B>(
    fleet: &Fleet,
    port: &'static str,
    body: B,
) -> Result<Bytes, RequestError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let s = &fleet.settings;
    let read = read_within(
        s.max_body_bytes,
        s.timeouts.body_read(),
        s.limits.min_body_rate_bytes_per_s,
        body,
    )
    .await;
    if let Err(RequestError::BodyTimeout { .. }) = &read {
        fleet.metrics.limits.timeout(port, "body_read");
    }
    read
}

/// Reads a whole body of at most `limit` bytes that arrives within `grace` plus
/// `received / min_rate` seconds.
async fn read_within<B>(
    limit: usize,
    grace: Duration,
    min_rate: u64,
    body: B,
) -> Result<Bytes, RequestError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // The declared length, read off the body (both HTTP/1 paths size a body by its
    // `Content-Length`).
    if body.size_hint().lower() > limit as u64 {
        return Err(RequestError::TooLarge { limit });
    }
    let start = Instant::now();
    let allowed = |received: usize| {
        let extra = if min_rate == 0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(received as f64 / min_rate as f64)
        };
        start + grace.saturating_add(extra)
    };
    let mut body = Limited::new(body, limit);
    // Created unpolled: it joins the timer wheel only if the body is not all there yet.
    let late = tokio::time::sleep_until(allowed(0));
    tokio::pin!(late);
    // Most bodies are one frame (they came with the head): a list only from the second on.
    let mut first: Option<Bytes> = None;
    let mut more: Vec<Bytes> = Vec::new();
    let mut received = 0usize;
    loop {
        tokio::select! {
            biased;
            frame = body.frame() => match frame {
                None => break,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        received += data.len();
                        if first.is_none() {
                            first = Some(data);
                        } else {
                            more.push(data);
                        }
                    }
                }
                Some(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                    return Err(RequestError::TooLarge { limit });
                }
                Some(Err(e)) => return Err(RequestError::ClientBody(e.to_string())),
            },
            () = &mut late => {
                let deadline = allowed(received);
                if Instant::now() >= deadline {
                    return Err(RequestError::BodyTimeout {
                        received,
                        elapsed_ms: start.elapsed().as_millis() as u64,
                    });
                }
                late.as_mut().reset(deadline);
            }
        }
    }
    let bytes = match first {
        None => Bytes::new(),
        Some(only) if more.is_empty() => only,
        Some(head) => {
            let mut all = BytesMut::with_capacity(received);
            all.extend_from_slice(&head);
            for c in more {
                all.extend_from_slice(&c);
            }
            all.freeze()
        }
    };
    Ok(bytes)
}

/// The request target as forwarded: path and query (a shared handle of the parsed request's,
/// not a copy).
pub(crate) fn path_and_query(uri: &Uri) -> PathAndQuery {
    uri.path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use axum::body::Body;
    use futures_util::StreamExt;

    /// A body that sends `chunk` bytes every `every`, `n` times.
    fn trickle(chunk: usize, every: Duration, n: usize) -> Body {
        let s = futures_util::stream::iter(0..n).then(move |_| async move {
            tokio::time::sleep(every).await;
            Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; chunk]))
        });
        Body::from_stream(s)
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickling_body_is_cut_and_a_steady_one_is_not() {
        let grace = Duration::from_secs(10);
        // 1 byte a second: far below 100 B/s once the grace period is over.
        let slow = trickle(1, Duration::from_secs(1), 1000);
        let err = read_within(1 << 20, grace, 100, slow).await.unwrap_err();
        assert!(
            matches!(err, RequestError::BodyTimeout { received: 10, .. }),
            "{err:?}"
        );
        assert_eq!(err.status(), http::StatusCode::REQUEST_TIMEOUT);

        // 200 B/s for 60 s: past the grace period, but above the rate.
        let steady = trickle(200, Duration::from_secs(1), 60);
        let body = read_within(1 << 20, grace, 100, steady).await.unwrap();
        assert_eq!(body.len(), 12_000);

        // Without a rate, the grace period bounds the whole body.
        let steady = trickle(200, Duration::from_secs(1), 60);
        let err = read_within(1 << 20, grace, 0, steady).await.unwrap_err();
        assert!(matches!(err, RequestError::BodyTimeout { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn size_limits_still_hold() {
        let req = Body::from(vec![0u8; 100]);
        let err = read_within(10, Duration::from_secs(1), 0, req)
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::TooLarge { limit: 10 }),
            "{err:?}"
        );
        let req = Body::from(vec![7u8; 100]);
        let b = read_within(100, Duration::from_secs(1), 0, req)
            .await
            .unwrap();
        assert_eq!(b.len(), 100);
    }

    #[tokio::test]
    async fn frames_are_joined_in_order_and_a_single_frame_is_not_copied() {
        let parts = ["{\"a\":", "", "[1,", "2]}"];
        let s = futures_util::stream::iter(parts)
            .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p.as_bytes())));
        let req = Body::from_stream(s);
        let b = read_within(100, Duration::from_secs(1), 0, req)
            .await
            .unwrap();
        assert_eq!(&b[..], b"{\"a\":[1,2]}");

        let one = Bytes::from_static(b"{\"prompt\":\"x\"}");
        let req = http_body_util::Full::new(one.clone());
        let b = read_within(100, Duration::from_secs(1), 0, req)
            .await
            .unwrap();
        assert_eq!(
            b.as_ptr(),
            one.as_ptr(),
            "one frame is handed on as it came"
        );
    }
}
