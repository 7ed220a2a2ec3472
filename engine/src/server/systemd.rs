//! sd_notify(3) without libsystemd: one datagram per state change to `$NOTIFY_SOCKET` (a path, or an
//! abstract socket written `@name`). Without a socket every call is a no-op, so the server runs the
//! same outside systemd.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Default)]
pub struct Notifier {
    socket: Option<PathBuf>,
}

impl Notifier {
    pub fn new(socket: Option<PathBuf>) -> Notifier {
        Notifier { socket }
    }

    pub fn ready(&self) {
        self.send("READY=1\nSTATUS=serving");
    }
    pub fn status(&self, text: &str) {
        self.send(&format!("STATUS={}", text.replace('\n', " ")));
    }
    pub fn watchdog(&self) {
        self.send("WATCHDOG=1");
    }
    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=draining");
    }

    fn send(&self, msg: &str) {
        let Some(path) = &self.socket else { return };
        if let Err(e) = send_to(path, msg) {
            tracing::warn!("sd_notify to {}: {e}", path.display());
        }
    }
}

fn send_to(path: &Path, msg: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let raw = path.as_os_str().as_encoded_bytes();
    if let Some(name) = raw.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(msg.as_bytes(), &addr)?;
    } else {
        sock.send_to(msg.as_bytes(), path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_reach_a_path_socket() {
        let dir = std::env::temp_dir().join(format!("kiln-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixDatagram::bind(&path).expect("bind");
        let n = Notifier::new(Some(path.clone()));
        n.status("loading 3/30");
        n.ready();
        let mut buf = [0u8; 256];
        let k = listener.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..k], b"STATUS=loading 3/30");
        let k = listener.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..k], b"READY=1\nSTATUS=serving");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
