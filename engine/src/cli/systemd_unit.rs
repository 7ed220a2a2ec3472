//! `kiln systemd-unit`: a systemd unit for hosts without NixOS, with the directives the NixOS
//! module sets: Type=notify (READY=1 after load and warm-up), ordering after the network and
//! nvidia-persistenced, LimitMEMLOCK=infinity, a long start timeout for model loading, restart on
//! failure with a start limit, the watchdog, start on boot, DynamicUser and a hardening block.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use kiln::lock::Lock;

#[derive(clap::Args)]
pub struct SystemdUnitArgs {
    /// The lock the service runs (`kiln serve --lock`); its environment goes into the unit.
    #[arg(long)]
    lock: Option<PathBuf>,
    /// Without --lock: a `kiln serve` config file (TOML) the service runs.
    #[arg(long, conflicts_with = "lock")]
    config: Option<PathBuf>,
    /// Instance name: the unit is kiln-NAME.service, its state and cache directories kiln/NAME.
    #[arg(long, default_value = "default")]
    name: String,
    /// The kiln binary [default: this one].
    #[arg(long)]
    exec: Option<PathBuf>,
    /// A file with the API key, handed to the service as a systemd credential.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Give the service the NVIDIA devices [default: when the lock was made on GPUs].
    #[arg(long)]
    gpu: bool,
    /// Seconds systemd waits for READY=1 (model loading).
    #[arg(long, default_value_t = 900)]
    start_timeout: u64,
    /// Watchdog period in seconds (kiln pings at half of it while the engine loop turns); 0: off.
    #[arg(long, default_value_t = 60)]
    watchdog: u64,
    /// With --lock, pass --canary (a short benchmark after warm-up, compared with the lock).
    #[arg(long)]
    canary: bool,
    /// Write the unit here instead of stdout.
    #[arg(long, short)]
    output: Option<PathBuf>,
}

fn absolute(p: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(p).with_context(|| format!("resolving {}", p.display()))
}

/// systemd's quoting for one ExecStart= argument taken literally: `$` and `%` are escaped so
/// neither variable expansion nor specifiers touch a path.
fn quote(arg: &str) -> String {
    let arg = &arg.replace('$', "$$").replace('%', "%%");
    if !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:,+@$%".contains(c))
    {
        arg.to_string()
    } else {
        format!("\"{}\"", arg.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

/// The directory a unit could not run a binary from: home directories (ProtectHome hides them)
/// and temporary ones (PrivateTmp gives the service its own, empty /tmp).
fn unreachable_dir(exec: &std::path::Path) -> Option<&'static str> {
    ["/root", "/home", "/tmp", "/var/tmp", "/run/user"]
        .into_iter()
        .find(|d| exec.starts_with(d))
}

pub fn run(a: SystemdUnitArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.name.is_empty()
            && a.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c)),
        "--name may hold only letters, digits, '-' and '_'"
    );
    let exec = match &a.exec {
        Some(p) => absolute(p)?,
        None => std::env::current_exe().context("finding the kiln binary")?,
    };
    let lock = match &a.lock {
        Some(p) => Some(Lock::read(p).map_err(|e| anyhow::anyhow!(e))?),
        None => None,
    };
    if let Some(dir) = unreachable_dir(&exec) {
        eprintln!(
            "kiln systemd-unit: warning: the binary {} is under {dir}, which the unit cannot \
             execute from (ProtectHome, PrivateTmp); install it under /usr/local/bin or /opt \
             and pass --exec",
            exec.display()
        );
    }
    let loopback = lock
        .as_ref()
        .and_then(|l| l.serve.get("host"))
        .and_then(|v| v.as_str())
        .is_none_or(|h| h == "127.0.0.1" || h == "::1" || h == "localhost");
    let gpu = a.gpu
        || lock
            .as_ref()
            .is_some_and(|l| !l.fingerprint.gpus.is_empty());
    // More than one GPU means NCCL: its bootstrap, interface probing and NUMA binding.
    let multi_gpu = lock.as_ref().is_some_and(|l| l.fingerprint.gpus.len() > 1);
    // `--instance` names the service in the logs and the metrics, as the NixOS module passes it.
    let mut args = vec![
        exec.display().to_string(),
        "serve".to_string(),
        "--instance".to_string(),
        a.name.clone(),
    ];
    let mut read_paths = Vec::new();
    if let Some(p) = &a.lock {
        let p = absolute(p)?;
        args.extend(["--lock".into(), p.display().to_string()]);
        read_paths.push(p);
        if a.canary {
            args.push("--canary".into());
        }
    } else if let Some(p) = &a.config {
        let p = absolute(p)?;
        args.extend(["--config".into(), p.display().to_string()]);
        read_paths.push(p);
    }
    if let Some(l) = &lock {
        read_paths.push(l.model.path.clone());
        if let Some(d) = &l.draft {
            read_paths.push(d.path.clone());
        }
    }
    for p in &read_paths {
        if p.starts_with("/root") || p.starts_with("/home") {
            eprintln!(
                "kiln systemd-unit: warning: {} is under a home directory, which the service's \
                 dynamic user cannot read; move it to /var/lib/kiln or /opt",
                p.display()
            );
        }
    }

    let shutdown_timeout = lock
        .as_ref()
        .and_then(|l| l.serve.get("shutdown-timeout"))
        .and_then(|v| v.as_integer())
        .unwrap_or(30);

    let mut u = String::new();
    let name = &a.name;
    let _ = writeln!(
        u,
        "# Generated by `kiln systemd-unit`{}.",
        match &a.lock {
            Some(p) => format!(" from {}", p.display()),
            None => String::new(),
        }
    );
    let _ = writeln!(u, "[Unit]");
    let _ = writeln!(u, "Description=kiln inference server ({name})");
    let _ = writeln!(u, "Documentation=man:systemd.service(5)");
    let after = if gpu {
        "network-online.target nvidia-persistenced.service"
    } else {
        "network-online.target"
    };
    let _ = writeln!(u, "After={after}");
    let _ = writeln!(u, "Wants={after}");
    let _ = writeln!(u, "StartLimitIntervalSec=1800");
    let _ = writeln!(u, "StartLimitBurst=5");
    let _ = writeln!(u);
    let _ = writeln!(u, "[Service]");
    let _ = writeln!(u, "Type=notify");
    let _ = writeln!(u, "NotifyAccess=main");
    let mut exec_line: Vec<String> = args.iter().map(|x| quote(x)).collect();
    if a.api_key_file.is_some() {
        // Expanded by systemd: the credential LoadCredential= below puts there.
        exec_line.push("--api-key-file ${CREDENTIALS_DIRECTORY}/api-key".into());
    }
    let _ = writeln!(u, "ExecStart={}", exec_line.join(" "));
    let _ = writeln!(u, "EnvironmentFile=-/etc/kiln/{name}.env");
    let _ = writeln!(u, "Environment=KILN_CACHE_DIR=%C/kiln/{name}");
    if gpu {
        // GPU indices count as nvidia-smi counts them; the driver's JIT cache survives restarts.
        let _ = writeln!(u, "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID");
        let _ = writeln!(u, "Environment=CUDA_CACHE_PATH=%C/kiln/{name}/cuda-jit");
    }
    let lock_sets = |k: &str| lock.as_ref().is_some_and(|l| l.env.contains_key(k));
    if multi_gpu && loopback && !lock_sets("NCCL_SOCKET_IFNAME") {
        // NCCL's bootstrap over loopback stays inside the IP filter below.
        let _ = writeln!(u, "Environment=NCCL_SOCKET_IFNAME=lo");
    }
    if let Some(l) = &lock {
        for (k, v) in &l.env {
            // Environment= expands specifiers but not variables: only `%` needs escaping.
            let assignment = format!("{k}={v}").replace('%', "%%");
            let _ = writeln!(u, "Environment=\"{}\"", assignment.replace('"', "\\\""));
        }
    }
    if let Some(f) = &a.api_key_file {
        let _ = writeln!(u, "LoadCredential=api-key:{}", absolute(f)?.display());
    }
    let _ = writeln!(u, "TimeoutStartSec={}", a.start_timeout);
    let _ = writeln!(u, "TimeoutStopSec={}", shutdown_timeout + 15);
    if a.watchdog > 0 {
        let _ = writeln!(u, "WatchdogSec={}", a.watchdog);
    }
    let _ = writeln!(u, "Restart=on-failure");
    let _ = writeln!(u, "RestartSec=10");
    let _ = writeln!(u, "LimitMEMLOCK=infinity");
    // A core dump of hundreds of GB of weights is a hazard; CUDA and NCCL open many files.
    let _ = writeln!(u, "LimitCORE=0");
    let _ = writeln!(u, "LimitNOFILE=1048576");
    // Loading logs a burst: keep it all.
    let _ = writeln!(u, "LogRateLimitIntervalSec=30s");
    let _ = writeln!(u, "LogRateLimitBurst=20000");
    let _ = writeln!(u, "DynamicUser=yes");
    let _ = writeln!(u, "StateDirectory=kiln/{name}");
    let _ = writeln!(u, "CacheDirectory=kiln/{name}");
    let _ = writeln!(u, "UMask=0077");
    let _ = writeln!(
        u,
        "# Hardening: the service reads its model and lock, and talks TCP."
    );
    for d in [
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "PrivateUsers=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "NoNewPrivileges=yes",
        "RemoveIPC=yes",
        "KeyringMode=private",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        "DevicePolicy=closed",
        // The start-up checks read /proc/cpuinfo and /proc/sys/kernel/osrelease (and, with a
        // GPU, /proc/driver/nvidia), which ProcSubset=pid would hide.
        "ProcSubset=all",
    ] {
        let _ = writeln!(u, "{d}");
    }
    if gpu {
        // The CUDA driver places pinned memory on the GPU's NUMA node and NCCL binds threads
        // there (the @resources calls), as the NixOS module allows.
        let _ = writeln!(u, "SystemCallFilter=~@privileged");
    } else {
        let _ = writeln!(u, "SystemCallFilter=~@privileged @resources");
    }
    if multi_gpu {
        // NCCL lists interfaces over netlink.
        let _ = writeln!(
            u,
            "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK"
        );
    } else {
        let _ = writeln!(u, "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX");
    }
    if gpu {
        // The GPU needs its device nodes; the CUDA driver JIT-compiles kernels into executable
        // memory, so MemoryDenyWriteExecute stays off.
        let _ = writeln!(u, "PrivateDevices=no");
        for dev in [
            "char-nvidiactl",
            "char-nvidia-caps",
            "char-nvidia-frontend",
            "char-nvidia-uvm",
        ] {
            let _ = writeln!(u, "DeviceAllow={dev} rw");
        }
        let _ = writeln!(u, "DeviceAllow=/dev/nvidia-uvm-tools rw");
    } else {
        let _ = writeln!(u, "PrivateDevices=yes");
        let _ = writeln!(u, "MemoryDenyWriteExecute=yes");
    }
    if loopback {
        let _ = writeln!(u, "IPAddressAllow=localhost");
        let _ = writeln!(u, "IPAddressDeny=any");
    }
    let _ = writeln!(u);
    let _ = writeln!(u, "[Install]");
    let _ = writeln!(u, "WantedBy=multi-user.target");
    match &a.output {
        Some(p) => std::fs::write(p, u).with_context(|| format!("writing {}", p.display()))?,
        None => print!("{u}"),
    }
    Ok(())
}
