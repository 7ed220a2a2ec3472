# services.kiln: kiln inference-server instances as systemd services (kiln-<name>.service).
#
# Each instance runs `kiln serve` either from a lock (`lockFile`: the configuration `kiln bench sweep`
# chose, with its model, settings and environment; the service runs exactly it and checks the
# machine against it at start) or from `model` + `settings`. The unit follows the plain unit that
# `kiln systemd-unit` writes for non-NixOS hosts: Type=notify (READY=1 after load and warm-up), the
# watchdog, ordering after nvidia-persistenced, LimitMEMLOCK=infinity, a long start timeout, restart
# with backoff, start on boot, DynamicUser and a hardening block in the style of nixpkgs' ollama module.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    mkOption
    mkEnableOption
    types
    literalExpression
    ;
  cfg = config.services.kiln;
  enabled = lib.filterAttrs (_: i: i.enable) cfg.instances;

  nvidiaDriver =
    lib.elem "nvidia" (config.services.xserver.videoDrivers or [ ])
    || (config.hardware.nvidia.datacenter.enable or false);
  persistenced = nvidiaDriver && (config.hardware.nvidia.nvidiaPersistenced or false);
  # kiln compiles its kernels at start with the NVRTC its package ships, and the driver must load
  # that NVRTC's PTX: each CUDA release's PTX ISA (9.0 for 13.0, 9.1 for 13.1) needs the driver
  # branch released with it. The CUDA package names its NVRTC (passthru.nvrtcVersion); a package
  # without one is taken as the flake's CUDA 13.0.
  driverVersion = config.hardware.nvidia.package.version or null;
  minDriverForNvrtc = {
    "13.0" = "580";
    "13.1" = "590";
  };
  nvrtcOf = pkg: pkg.nvrtcVersion or "13.0";
  minDriverOf = pkg: minDriverForNvrtc.${lib.versions.majorMinor (nvrtcOf pkg)} or null;

  # One ExecStart= argument taken literally: JSON string quoting is systemd's double-quote syntax;
  # `%` (specifiers) and `$` (variables) are doubled so neither touches a path.
  escapeExecArg = a: builtins.replaceStrings [ "%" "$" ] [ "%%" "$$" ] (builtins.toJSON (toString a));

  # kiln's config file is flat `key = value` TOML; JSON scalars and arrays of them are valid TOML.
  tomlValue =
    v:
    if builtins.isBool v then
      lib.boolToString v
    else if builtins.isList v then
      "[${lib.concatMapStringsSep ", " tomlValue v}]"
    else
      builtins.toJSON v;
  renderSettings =
    settings:
    lib.concatStrings (
      lib.mapAttrsToList (k: v: "${k} = ${tomlValue v}\n") (lib.filterAttrs (_: v: v != null) settings)
    );

  # A model given as a package: `passthru.modelFile` names the file inside it (packages.default-model),
  # otherwise the package itself is the model (a .gguf file or a Hugging Face directory).
  modelPath = m: if lib.isDerivation m && m ? modelFile then "${m}/${m.modelFile}" else "${m}";

  isLoopback =
    h:
    lib.elem h [
      "127.0.0.1"
      "::1"
      "localhost"
    ];
  # A wildcard address takes the port on every address, so it clashes with any other bind of it.
  isWildcard =
    h:
    lib.elem h [
      "0.0.0.0"
      "::"
      "*"
      ""
    ];
  sameAddress = a: b: a == b || (isLoopback a && isLoopback b);
  clash =
    a: b: a.port == b.port && (isWildcard a.host || isWildcard b.host || sameAddress a.host b.host);

  # A secret or an environment file: an absolute path kept out of the store. A string, so a path
  # literal (which Nix would copy into the world-readable store) is a type error.
  outsideStore = types.strMatching "/.+";
  inStore = p: p != null && lib.hasPrefix "${builtins.storeDir}/" p;

  ncclOptions = {
    p2pLevel = mkOption {
      type = types.nullOr (
        types.enum [
          "LOC"
          "NVL"
          "PIX"
          "PXB"
          "PHB"
          "SYS"
        ]
      );
      default = null;
      example = "SYS";
      description = "NCCL_P2P_LEVEL: how far apart two GPUs may be for NCCL to use peer-to-peer. PCIe-only boxes whose GPUs sit behind different root ports need PHB or SYS (with ACS off, see hosts/reference).";
    };
    minNChannels = mkOption {
      type = types.nullOr types.ints.positive;
      default = null;
      example = 8;
      description = "NCCL_MIN_NCHANNELS: more channels raise all-reduce bandwidth over PCIe.";
    };
    proto = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "LL";
      description = "NCCL_PROTO: the protocols NCCL may use (LL is the low-latency one that small decode all-reduces want).";
    };
    algo = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "Ring";
      description = "NCCL_ALGO.";
    };
    ibDisable = mkOption {
      type = types.nullOr types.bool;
      default = null;
      example = true;
      description = "NCCL_IB_DISABLE: a single box has no InfiniBand; disabling it skips the probe.";
    };
    socketIfname = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "lo";
      description = "NCCL_SOCKET_IFNAME: the interface for NCCL's bootstrap.";
    };
    debug = mkOption {
      type = types.nullOr (
        types.enum [
          "VERSION"
          "WARN"
          "INFO"
          "TRACE"
        ]
      );
      default = null;
      description = "NCCL_DEBUG.";
    };
    extraEnv = mkOption {
      type = types.attrsOf types.str;
      default = { };
      example = {
        NCCL_GRAPH_FILE = "/etc/kiln/nccl-graph.xml";
      };
      description = "Further NCCL_* variables.";
    };
  };

  ncclEnv =
    n:
    lib.filterAttrs (_: v: v != null) {
      NCCL_P2P_LEVEL = n.p2pLevel;
      NCCL_MIN_NCHANNELS = if n.minNChannels == null then null else toString n.minNChannels;
      NCCL_PROTO = n.proto;
      NCCL_ALGO = n.algo;
      NCCL_IB_DISABLE =
        if n.ibDisable == null then
          null
        else if n.ibDisable then
          "1"
        else
          "0";
      NCCL_SOCKET_IFNAME = n.socketIfname;
      NCCL_DEBUG = n.debug;
    }
    // n.extraEnv;

  instanceModule =
    { name, config, ... }:
    {
      options = {
        enable = mkEnableOption "this kiln instance" // {
          default = true;
        };
        package = mkOption {
          type = types.package;
          default = cfg.package;
          defaultText = literalExpression "config.services.kiln.package";
          description = "The kiln package (the flake's `packages.default` for the CPU, `packages.cuda` for GPUs).";
        };
        lockFile = mkOption {
          type = types.nullOr types.path;
          default = null;
          example = literalExpression "./kiln.lock";
          description = ''
            A lock from `kiln lock create`. The service runs exactly it (`kiln serve --lock`): its model,
            settings and environment, after checking the machine against its fingerprint. `model` and
            `settings` must then stay unset: a different configuration is a new sweep and a new lock.
            The lock is copied into the store and is part of the system closure, so it survives
            garbage collection, remote deploys and rollbacks with the generation that uses it.
          '';
        };
        driftPolicy = mkOption {
          type = types.nullOr (
            types.enum [
              "warn"
              "refuse"
            ]
          );
          default = null;
          description = "With a lock: on drift from its fingerprint, serve anyway (warn) or fail the start (refuse). Default: the lock's own policy.";
        };
        skipModelHash = mkOption {
          type = types.bool;
          default = false;
          description = "With a lock: skip hashing the model at start (`--skip-model-hash`); a model of hundreds of GB takes minutes to hash. The size is still checked.";
        };
        canary = mkOption {
          type = types.bool;
          default = false;
          description = "With a lock: after warm-up, run a short benchmark and compare it with the locked numbers before reporting ready.";
        };
        model = mkOption {
          type = types.nullOr (types.either types.package outsideStore);
          default = null;
          example = literalExpression "kiln.packages.x86_64-linux.default-model";
          description = "Without a lock: the model, a package holding one, or an absolute path (a string: a model of hundreds of GB is never copied into the store) to a .gguf file or a Hugging Face directory.";
        };
        settings = mkOption {
          type = types.attrsOf (
            types.nullOr (
              types.oneOf [
                types.bool
                types.int
                types.float
                types.str
                (types.listOf (types.either types.int types.str))
              ]
            )
          );
          default = { };
          example = {
            max-running = 32;
            speculative-algorithm = "ngram";
          };
          description = "Without a lock: `kiln serve` settings (keys as its flag names, see `kiln serve --help`), rendered to the instance's config file.";
        };
        host = mkOption {
          type = types.nullOr types.str;
          default = null;
          example = "0.0.0.0";
          description = "Address to bind. Default: the lock's, else 127.0.0.1.";
        };
        port = mkOption {
          type = types.nullOr types.port;
          default = null;
          description = "TCP port. Default: the lock's, else 8000.";
        };
        openFirewall = mkOption {
          type = types.bool;
          default = false;
          description = "Open the port in the firewall (needs a non-loopback host).";
        };
        apiKeyFile = mkOption {
          type = types.nullOr outsideStore;
          default = null;
          example = "/run/secrets/kiln-api-key";
          description = "The absolute path (a string, never a path literal, which would copy the secret into the world-readable store) of a file holding the API key clients must send as a Bearer token; handed to the service as a systemd credential, so it may be readable by root only.";
        };
        environmentFile = mkOption {
          type = types.nullOr outsideStore;
          default = null;
          example = "/run/secrets/kiln.env";
          description = "The absolute path (a string, kept out of the store) of an environment file systemd reads at start (EnvironmentFile=): secrets such as HF_TOKEN. Set NCCL variables through `nccl` (or the lock) instead: the unit's IP filter follows `nccl.socketIfname`, which it cannot read from this file.";
        };
        gpus = mkOption {
          type = types.listOf types.ints.unsigned;
          default = [ ];
          example = [
            0
            1
            2
            3
            4
            5
            6
            7
          ];
          description = "GPU indices the instance uses, in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID, as nvidia-smi numbers them; CUDA_VISIBLE_DEVICES). Non-empty: the unit gets exactly these GPUs' device nodes (/dev/nvidiaN) and orders after nvidia-persistenced. Two instances never share a GPU.";
        };
        nccl = mkOption {
          type = types.submodule { options = ncclOptions; };
          default = { };
          description = "NCCL tuning for tensor parallelism.";
        };
        environment = mkOption {
          type = types.attrsOf types.str;
          default = { };
          description = "Further environment variables.";
        };
        extraArgs = mkOption {
          type = types.listOf types.str;
          default = [ ];
          description = "Further `kiln serve` arguments.";
        };
        startTimeout = mkOption {
          type = types.ints.positive;
          default = 900;
          description = "Seconds systemd waits for READY=1: loading and warming up a large model takes minutes.";
        };
        watchdogSec = mkOption {
          type = types.ints.unsigned;
          default = 60;
          description = "Watchdog period (kiln pings at half of it while its engine loop turns); 0 disables it.";
        };
      };
    };

  # What an instance resolves to: the lock (read at evaluation time) supplies host, port, model and
  # environment unless the instance sets them.
  resolve =
    name: i:
    let
      lock = if i.lockFile == null then null else builtins.fromTOML (builtins.readFile i.lockFile);
      # The lock as a store path with its string context: the unit depends on it, so it is in the
      # system closure (a plain path string would point outside the store).
      lockInStore =
        if i.lockFile == null then
          null
        else
          "${builtins.path {
            path = i.lockFile;
            name = "kiln-${name}.lock";
          }}";
      multiGpu = lib.length i.gpus > 1;
      locked = key: if lock == null then null else lock.serve.${key} or null;
      host =
        if i.host != null then
          i.host
        else if locked "host" != null then
          locked "host"
        else
          "127.0.0.1";
      port =
        if i.port != null then
          i.port
        else if locked "port" != null then
          locked "port"
        else
          8000;
      lockEnv = if lock == null then { } else lock.env or { };
      env = instanceEnv name i lockEnv;
      configFile = pkgs.writeText "kiln-${name}.toml" (renderSettings i.settings);
      args = [
        "${i.package}/bin/kiln"
        "serve"
        "--instance"
        name
      ]
      ++ (
        if lock != null then
          [
            "--lock"
            lockInStore
          ]
          ++ lib.optional i.skipModelHash "--skip-model-hash"
          ++ lib.optionals (i.driftPolicy != null) [
            "--drift-policy"
            i.driftPolicy
          ]
          ++ lib.optional i.canary "--canary"
        else
          lib.optionals (i.settings != { }) [
            "--config"
            configFile
          ]
          ++ lib.optionals (i.model != null) [
            "--model"
            (modelPath i.model)
          ]
          ++ lib.optionals (i.host != null) [
            "--host"
            i.host
          ]
          ++ lib.optionals (i.port != null) [
            "--port"
            (toString i.port)
          ]
      )
      ++ i.extraArgs;
    in
    {
      inherit
        lock
        lockInStore
        host
        port
        lockEnv
        args
        multiGpu
        env
        ;
      gpu = i.gpus != [ ];
      # NCCL's bootstrap is a TCP exchange between the ranks of this one box: over loopback it
      # stays inside the unit's IP filter (set NCCL_SOCKET_IFNAME to use another interface).
      ncclBootstrapOnLoopback = multiGpu && (env.NCCL_SOCKET_IFNAME or "lo") == "lo";
    };

  instanceEnv =
    name: i: lockEnv:
    let
      multiGpu = lib.length i.gpus > 1;
    in
    lib.optionalAttrs multiGpu { NCCL_SOCKET_IFNAME = "lo"; }
    // lockEnv
    // ncclEnv i.nccl
    // lib.optionalAttrs (i.gpus != [ ]) {
      # The indices count as nvidia-smi and /dev/nvidiaN do, whatever CUDA would rank fastest.
      CUDA_DEVICE_ORDER = "PCI_BUS_ID";
      CUDA_VISIBLE_DEVICES = lib.concatMapStringsSep "," toString i.gpus;
      # The driver's JIT cache (PTX compiled for this GPU) in the instance's cache directory, so a
      # restart reuses it instead of compiling every kernel again.
      CUDA_CACHE_PATH = "/var/cache/kiln/${name}/cuda-jit";
      CUDA_CACHE_MAXSIZE = "1073741824";
    }
    // {
      KILN_CACHE_DIR = "/var/cache/kiln/${name}";
    }
    // i.environment;

  resolved = lib.mapAttrs resolve enabled;

  unit =
    name: i:
    let
      r = resolved.${name};
      ordering = [
        "network-online.target"
      ]
      ++ lib.optional (r.gpu && persistenced) "nvidia-persistenced.service";
      execStart =
        lib.concatMapStringsSep " " escapeExecArg r.args
        # Expanded by systemd at start: where LoadCredential= below puts the key.
        + lib.optionalString (i.apiKeyFile != null) " --api-key-file \${CREDENTIALS_DIRECTORY}/api-key";
      shutdownTimeout =
        if r.lock != null then r.lock.serve.shutdown-timeout or 30 else i.settings.shutdown-timeout or 30;
    in
    {
      description = "kiln inference server (${name})";
      documentation = [ "man:systemd.service(5)" ];
      after = ordering;
      wants = ordering;
      wantedBy = [ "multi-user.target" ];
      # At most 5 failed starts in 30 minutes, then systemd gives up and the unit shows as failed.
      startLimitIntervalSec = 1800;
      startLimitBurst = 5;
      environment = r.env;
      # The start-up checks read the GPUs with nvidia-smi (the fingerprint against the lock).
      path = lib.optional (r.gpu && config.hardware.nvidia ? package) (
        lib.getBin config.hardware.nvidia.package
      );
      serviceConfig = {
        Type = "notify";
        NotifyAccess = "main";
        ExecStart = execStart;
        TimeoutStartSec = i.startTimeout;
        TimeoutStopSec = shutdownTimeout + 15;
        WatchdogSec = if i.watchdogSec == 0 then "infinity" else i.watchdogSec;
        Restart = "on-failure";
        # Backoff: 10 s after the first failure, growing to 5 minutes over 5 restarts.
        RestartSec = 10;
        RestartSteps = 5;
        RestartMaxDelaySec = 300;
        LimitMEMLOCK = "infinity";
        # A core dump of a process holding hundreds of GB of weights would fill the disk and
        # stall the restart; CUDA and NCCL open many descriptors per GPU.
        LimitCORE = 0;
        LimitNOFILE = 1048576;
        # Loading logs a burst (a line per shard, NCCL's INFO lines at start): keep it all.
        LogRateLimitIntervalSec = "30s";
        LogRateLimitBurst = 20000;
        EnvironmentFile = lib.optional (i.environmentFile != null) i.environmentFile;
        DynamicUser = true;
        StateDirectory = "kiln/${name}";
        CacheDirectory = "kiln/${name}";
        UMask = "0077";
        LoadCredential = lib.optional (i.apiKeyFile != null) "api-key:${i.apiKeyFile}";

        # Hardening: the service reads its model and lock, and talks TCP.
        ProtectSystem = "strict";
        ProtectHome = true;
        PrivateTmp = true;
        PrivateUsers = true;
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        ProtectProc = "invisible";
        # The start-up checks read /proc/cpuinfo and /proc/sys/kernel/osrelease (and, with a GPU,
        # /proc/driver/nvidia), which ProcSubset=pid would hide.
        ProcSubset = "all";
        RestrictNamespaces = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        NoNewPrivileges = true;
        RemoveIPC = true;
        KeyringMode = "private";
        CapabilityBoundingSet = "";
        AmbientCapabilities = "";
        SystemCallArchitectures = "native";
        # The CUDA driver places pinned host memory on the GPU's NUMA node and NCCL binds each
        # rank's threads there (sched_setaffinity, set_mempolicy, mbind: the @resources set), so
        # a GPU unit keeps them, as nixpkgs' ollama unit does.
        SystemCallFilter = [
          "@system-service"
          (if r.gpu then "~@privileged" else "~@privileged @resources")
        ];
        SystemCallErrorNumber = "EPERM";
        # NCCL enumerates interfaces over netlink for its bootstrap.
        RestrictAddressFamilies = [
          "AF_INET"
          "AF_INET6"
          "AF_UNIX"
        ]
        ++ lib.optional r.multiGpu "AF_NETLINK";
        DevicePolicy = "closed";
        # The GPU needs its device nodes (PrivateDevices would hide them), and the CUDA driver
        # JIT-compiles kernels into executable memory, so MemoryDenyWriteExecute stays off with one.
        PrivateDevices = !r.gpu;
        MemoryDenyWriteExecute = !r.gpu;
        # The control and unified-memory nodes every CUDA process opens, and only this
        # instance's own GPUs (another instance's are not even visible).
        DeviceAllow =
          lib.optionals r.gpu [
            "/dev/nvidiactl rw"
            "char-nvidia-caps rw"
            "char-nvidia-uvm rw"
          ]
          ++ map (n: "/dev/nvidia${toString n} rw") i.gpus;
      }
      # Loopback-only: the API and, with several GPUs, NCCL's bootstrap (over `lo`) stay inside.
      // lib.optionalAttrs (isLoopback r.host && (!r.multiGpu || r.ncclBootstrapOnLoopback)) {
        IPAddressAllow = "localhost";
        IPAddressDeny = "any";
      };
    };

  instanceAssertions =
    name: i:
    let
      r = resolved.${name};
      at = "services.kiln.instances.${name}";
      typedNccl = ncclEnv i.nccl;
      ncclConflicts = lib.filterAttrs (k: v: r.lockEnv ? ${k} && r.lockEnv.${k} != v) typedNccl;
    in
    [
      {
        assertion = i.lockFile == null || (i.model == null && i.settings == { });
        message = "${at}: lockFile fixes the model and every setting; unset model and settings, or make a new lock with `kiln bench sweep` and `kiln lock create`.";
      }
      {
        assertion =
          r.lock == null
          || (
            (i.host == null || i.host == (r.lock.serve.host or "127.0.0.1"))
            && (i.port == null || i.port == (r.lock.serve.port or 8000))
          );
        message = "${at}: host/port differ from the lock's [serve] host and port, which the service binds; drop them or make a new lock.";
      }
      {
        assertion = i.lockFile != null || (!i.canary && i.driftPolicy == null);
        message = "${at}: canary and driftPolicy compare the machine with a lock; set lockFile.";
      }
      {
        assertion = !(i.openFirewall && isLoopback r.host);
        message = "${at}: openFirewall is set but the instance binds ${r.host}; set host = \"0.0.0.0\" (with apiKeyFile) or drop openFirewall.";
      }
      {
        assertion = !r.gpu || minDriverOf i.package != null;
        message = "${at}: the kiln package ships NVRTC ${nvrtcOf i.package}, and the module does not know the oldest NVIDIA driver that loads its PTX; add it to minDriverForNvrtc.";
      }
      {
        assertion =
          !r.gpu
          || driverVersion == null
          || minDriverOf i.package == null
          || lib.versionAtLeast driverVersion (minDriverOf i.package);
        message = "${at}: the kiln package ships NVRTC ${nvrtcOf i.package}, whose PTX needs NVIDIA driver ${toString (minDriverOf i.package)} or newer; hardware.nvidia.package is ${toString driverVersion}.";
      }
      {
        assertion = !r.gpu || nvidiaDriver;
        message = "${at}: gpus = [ ${
          lib.concatMapStringsSep " " toString i.gpus
        } ] but the NVIDIA driver is not enabled; add \"nvidia\" to services.xserver.videoDrivers (see hosts/reference).";
      }
      {
        assertion = ncclConflicts == { };
        message = "${at}: the nccl options ${
          lib.concatStringsSep ", " (lib.mapAttrsToList (k: v: "${k}=${v}") ncclConflicts)
        } differ from the lock's environment (${
          lib.concatStringsSep ", " (lib.mapAttrsToList (k: _: "${k}=${r.lockEnv.${k}}") ncclConflicts)
        }); the lock was measured with its values: re-run the sweep with the new ones or drop the options.";
      }
      {
        assertion = !(inStore i.apiKeyFile || inStore i.environmentFile);
        message = "${at}: apiKeyFile and environmentFile must lie outside the Nix store, which every user can read; keep secrets in /run/secrets or /etc with root-only permissions.";
      }
      {
        assertion = i.lockFile != null || !i.skipModelHash;
        message = "${at}: skipModelHash skips the lock's model hash check; set lockFile.";
      }
      {
        assertion =
          r.lock == null
          || !(r.lock ? fingerprint)
          || lib.length (r.lock.fingerprint.gpus or [ ]) == lib.length i.gpus;
        message = "${at}: the lock was measured on ${
          toString (lib.length (r.lock.fingerprint.gpus or [ ]))
        } GPU(s) but gpus lists ${toString (lib.length i.gpus)}; give the instance the GPUs the lock was made on, or make a new lock.";
      }
      {
        assertion = !(i.settings ? host || i.settings ? port || i.settings ? api-key || i.settings ? model);
        message = "${at}: set host, port, model and the API key (apiKeyFile) through their own options, not settings.";
      }
    ];

  # Every pair of enabled instances, once.
  pairs =
    let
      names = lib.attrNames enabled;
    in
    lib.concatLists (lib.imap0 (k: a: map (b: { inherit a b; }) (lib.drop (k + 1) names)) names);
  pairAssertions = lib.concatMap (
    { a, b }:
    let
      ra = resolved.${a};
      rb = resolved.${b};
      shared = lib.intersectLists enabled.${a}.gpus enabled.${b}.gpus;
    in
    [
      {
        assertion = !(clash ra rb);
        message = "services.kiln.instances: ${a} (${ra.host}:${toString ra.port}) and ${b} (${rb.host}:${toString rb.port}) both bind port ${toString ra.port}.";
      }
      {
        assertion = shared == [ ];
        message = "services.kiln.instances: ${a} and ${b} share GPU(s) ${
          lib.concatMapStringsSep ", " toString shared
        }; each GPU serves one instance.";
      }
    ]
  ) pairs;
in
{
  options.services.kiln = {
    package = mkOption {
      type = types.package;
      description = "The default kiln package for instances (the flake sets its CPU build).";
    };
    instances = mkOption {
      type = types.attrsOf (types.submodule instanceModule);
      default = { };
      example = literalExpression ''
        {
          main = {
            package = kiln.packages.x86_64-linux.cuda;
            lockFile = ./kiln.lock;
            gpus = [ 0 1 2 3 4 5 6 7 ];
            apiKeyFile = "/run/secrets/kiln-api-key";
          };
        }
      '';
      description = "kiln instances, each a `kiln-<name>.service`.";
    };
  };

  config = lib.mkIf (enabled != { }) {
    assertions = lib.concatLists (lib.mapAttrsToList instanceAssertions enabled) ++ pairAssertions;
    warnings = lib.concatLists (
      lib.mapAttrsToList (
        name: i:
        lib.optional (!resolved.${name}.gpu && ncclEnv i.nccl != { })
          "services.kiln.instances.${name}: nccl options are set but gpus is empty; NCCL only runs between GPUs."
        ++
          lib.optional (!(isLoopback resolved.${name}.host) && i.apiKeyFile == null)
            "services.kiln.instances.${name}: binds ${resolved.${name}.host} without apiKeyFile: anyone who reaches the port can use the model."
      ) enabled
    );
    systemd.services = lib.mapAttrs' (name: i: lib.nameValuePair "kiln-${name}" (unit name i)) enabled;
    networking.firewall.allowedTCPPorts = lib.concatLists (
      lib.mapAttrsToList (name: i: lib.optional i.openFirewall resolved.${name}.port) enabled
    );
  };
}
