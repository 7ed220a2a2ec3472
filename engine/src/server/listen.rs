//! The HTTP/1.1 accept loop, with the limits a public server needs that `axum::serve` does not
//! set: a connection must send a request's headers within `--header-timeout` (a silent socket,
//! or a keep-alive connection idle that long, is closed), and at most `--max-connections` are
//! open at once (kept under the process's file-descriptor limit). At the cap, the oldest idle
//! connection (no request in progress, no response streaming) is closed to make room, so silent
//! sockets cannot keep `/health` or a real client waiting; when every connection is busy, new
//! ones wait in the listen queue. A failed accept (descriptors exhausted) backs off.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

/// Descriptors kept for everything else the process opens (model files, logs, the engine).
const SPARE_DESCRIPTORS: u64 = 64;

#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub header_timeout: Duration,
    pub max_connections: usize,
}

/// `wanted` connections, or fewer when the soft file-descriptor limit would not hold them.
pub fn connection_cap(wanted: usize) -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
    if !ok || lim.rlim_cur == libc::RLIM_INFINITY {
        return wanted;
    }
    let room = lim.rlim_cur.saturating_sub(SPARE_DESCRIPTORS).max(8);
    wanted.min(room as usize)
}

/// One open connection as the accept loop sees it.
struct Conn {
    opened: Instant,
    /// Requests in progress, streaming response bodies included.
    busy: AtomicUsize,
    /// Told to close (it is idle and the server is at its cap).
    evict: Notify,
}

/// Keeps a connection busy while a response (or its streamed body) is alive.
struct Busy(Arc<Conn>);

impl Busy {
    fn new(c: &Arc<Conn>) -> Busy {
        c.busy.fetch_add(1, Ordering::AcqRel);
        Busy(c.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its connection marked busy until it is finished or dropped.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The open connections, for eviction at the cap.
#[derive(Default)]
struct Registry {
    conns: Mutex<Vec<Arc<Conn>>>,
}

impl Registry {
    fn add(&self, c: Arc<Conn>) {
        if let Ok(mut v) = self.conns.lock() {
            v.push(c);
        }
    }

    fn remove(&self, c: &Arc<Conn>) {
        if let Ok(mut v) = self.conns.lock() {
            v.retain(|x| !Arc::ptr_eq(x, c));
        }
    }

    /// Tells the oldest idle connection to close; `false` when every connection is busy.
    fn evict_oldest_idle(&self) -> bool {
        let Ok(v) = self.conns.lock() else {
            return false;
        };
        let idle = v
            .iter()
            .filter(|c| c.busy.load(Ordering::Acquire) == 0)
            .min_by_key(|c| c.opened);
        match idle {
            Some(c) => {
                c.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Serves `router` until `stop` fires, then waits for the open connections to finish their
/// requests (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let registry = Arc::new(Registry::default());
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // At the cap: make room by closing an idle connection, or wait for one to end.
                registry.evict_oldest_idle();
                tokio::select! {
                    p = permits.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                    _ = &mut stop => break,
                }
            }
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!("accept failed: {e}; retrying shortly");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let conn_state = Arc::new(Conn {
            opened: Instant::now(),
            busy: AtomicUsize::new(0),
            evict: Notify::new(),
        });
        registry.add(conn_state.clone());
        let svc = {
            let (router, conn_state) = (router.clone(), conn_state.clone());
            hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let busy = Busy::new(&conn_state);
                let router = router.clone();
                async move {
                    let resp = router.oneshot(req.map(Body::new)).await;
                    resp.map(|r| {
                        r.map(|b| {
                            Body::new(Tracked {
                                inner: b,
                                _busy: busy,
                            })
                        })
                    })
                }
            })
        };
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn);
        let registry = registry.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = conn => {}
                // Dropping the connection closes its socket.
                _ = conn_state.evict.notified() => {}
            }
            registry.remove(&conn_state);
            drop(permit);
        });
    }
    graceful.shutdown().await;
}
