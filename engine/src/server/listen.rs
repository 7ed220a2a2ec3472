//! The HTTP/1.1 accept loop, with the limits a public server needs that `axum::serve` does not
//! set: a connection must send a request's headers within `--header-timeout` (a silent socket,
//! or a keep-alive connection idle that long, is closed), at most `--max-connections` are open
//! at once (kept under the process's file-descriptor limit, so `/health` always has one to
//! answer on), and a failed accept (descriptors exhausted) backs off instead of spinning.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

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

/// Serves `router` until `stop` fires, then waits for the open connections to finish their
/// requests (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        // At the cap, stop accepting: the kernel queues new connections until one closes.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut stop => break,
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
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(
                TokioIo::new(stream),
                TowerToHyperService::new(router.clone()),
            );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    graceful.shutdown().await;
}
