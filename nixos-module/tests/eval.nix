# Offline evaluation of the module against the real nixpkgs `lib` (no nixpkgs package set needed):
# the NixOS options the module writes to are declared here as plain options, then each scenario is
# evaluated and its unit, environment, firewall and assertions are compared with what they must be.
#
#   nix-instantiate --eval --strict --json nixos-module/tests/eval.nix --arg lib 'import <nixpkgs.lib>/lib'
#
# Result: a list of { name, ok, got } records; .ci/nix-checks.sh fails on any ok = false.
{ lib }:
let
  inherit (import ./harness.nix { inherit lib; })
    scenarios
    instanceOptions
    fakePackage
    kiln
    defaultModel
    kilnFlake
    eval
    ;

  # 4. The committed hosts.
  reference = eval ../../hosts/reference;
  referenceUnit = reference.systemd.services.kiln-main;
  referenceConfig = builtins.readFile (
    lib.head (
      lib.splitString "\"" (
        lib.head (lib.tail (lib.splitString "\"--config\" \"" referenceUnit.serviceConfig.ExecStart))
      )
    )
  );
  cpuHost = eval ../../hosts/cpu;
  cpuHostUnit = cpuHost.systemd.services.kiln-default;

  failed = c: map (a: a.message) (lib.filter (a: !a.assertion) c.assertions);
  check = name: ok: got: { inherit name ok got; };
  contains = needle: haystack: lib.hasInfix needle haystack;
  anyContains = needle: lib.any (contains needle);

  # 1. CPU instance with the default-model package, settings and secrets.
  cpu = eval scenarios.cpu;
  cpuUnit = cpu.systemd.services.kiln-dev;
  cpuSc = cpuUnit.serviceConfig;
  configFile = lib.head (lib.tail (lib.splitString "\"--config\" \"" cpuSc.ExecStart));
  configPath = lib.head (lib.splitString "\"" configFile);

  # 2. The reference shape: GPUs, a lock, an API key, an open port.
  gpu = eval scenarios.gpu;
  gpuUnit = gpu.systemd.services.kiln-main;
  gpuSc = gpuUnit.serviceConfig;

  # 3. Contradictions, each with the assertion that must fire.
  bad = {
    lockAndSettings = eval {
      services.kiln.instances.x = {
        lockFile = ./gpu.lock;
        settings.max-running = 4;
      };
    };
    firewallOnLoopback = eval { services.kiln.instances.x.openFirewall = true; };
    gpusWithoutDriver = eval { services.kiln.instances.x.gpus = [ 0 ]; };
    ncclAgainstLock = eval {
      services.xserver.videoDrivers = [ "nvidia" ];
      services.kiln.instances.x = {
        lockFile = ./gpu.lock;
        gpus = [ 0 ];
        nccl.p2pLevel = "PHB";
      };
    };
    samePort = eval {
      services.kiln.instances.a = { };
      services.kiln.instances.b = { };
    };
    canaryWithoutLock = eval { services.kiln.instances.x.canary = true; };
    hostInSettings = eval { services.kiln.instances.x.settings.port = 9000; };
    portAgainstLock = eval {
      services.kiln.instances.x = {
        lockFile = ./gpu.lock;
        port = 8000;
      };
    };
    wildcardPort = eval {
      services.kiln.instances.a.host = "0.0.0.0";
      services.kiln.instances.b.port = 8000;
    };
    sharedGpu = eval {
      services.xserver.videoDrivers = [ "nvidia" ];
      services.kiln.instances.a.gpus = [
        0
        1
      ];
      services.kiln.instances.b = {
        gpus = [
          1
          2
        ];
        port = 8001;
      };
    };
    lockGpuCount = eval {
      services.xserver.videoDrivers = [ "nvidia" ];
      services.kiln.instances.x = {
        lockFile = ./gpu.lock;
        gpus = lib.range 0 3;
      };
    };
    oldDriver = eval {
      services.xserver.videoDrivers = [ "nvidia" ];
      hardware.nvidia.package = fakePackage "nvidia-x11" { version = "570.172.08"; };
      services.kiln.instances.x.gpus = [ 0 ];
    };
    # A package built against CUDA 13.1's NVRTC on the 580 driver: its PTX would not load.
    newerNvrtc = eval {
      services.xserver.videoDrivers = [ "nvidia" ];
      hardware.nvidia.package = fakePackage "nvidia-x11" { version = "580.95.05"; };
      services.kiln.instances.x.gpus = [ 0 ];
      services.kiln.instances.x.package = fakePackage "kiln-cuda" {
        kilnCuda = true;
        nvrtcVersion = "13.1.80";
      };
    };
    unknownNvrtc = eval {
      services.xserver.videoDrivers = [ "nvidia" ];
      services.kiln.instances.x.gpus = [ 0 ];
      services.kiln.instances.x.package = fakePackage "kiln-cuda" {
        kilnCuda = true;
        nvrtcVersion = "14.0.1";
      };
    };
    secretInStore = eval {
      services.kiln.instances.x.apiKeyFile = "/nix/store/00000000000000000000000000000000-key";
    };
    skipHashWithoutLock = eval { services.kiln.instances.x.skipModelHash = true; };
  };

  # 5. Two instances splitting the eight GPUs, on loopback, with a lock each way but no lock here.
  split = eval {
    services.xserver.videoDrivers = [ "nvidia" ];
    services.kiln.instances.left = {
      gpus = lib.range 0 3;
      model = "/var/lib/kiln/models/left";
      environmentFile = "/run/secrets/kiln-left.env";
    };
    services.kiln.instances.right = {
      gpus = lib.range 4 7;
      model = "/var/lib/kiln/models/right";
      port = 8001;
    };
  };
  left = split.systemd.services.kiln-left;
  right = split.systemd.services.kiln-right;

  # 6. Secrets and models as path literals would be copied into the store: their types refuse
  # them (asked of the module's own option types).
  accepts = option: v: instanceOptions.${option}.type.check v;
  lockStorePaths = lib.attrNames (builtins.getContext gpuSc.ExecStart);
  expectFailure =
    name: needle:
    let
      got = failed bad.${name};
    in
    check "assertion ${name}" (anyContains needle got) got;
in
[
  (check "cpu: no assertion fails" (failed cpu == [ ]) (failed cpu))
  (check "cpu: Type=notify" (cpuSc.Type == "notify") cpuSc.Type)
  (check "cpu: ExecStart runs the package"
    (lib.hasPrefix "\"${kiln}/bin/kiln\" \"serve\" \"--instance\" \"dev\"" cpuSc.ExecStart)
    cpuSc.ExecStart
  )
  (check "cpu: the model file inside the model package"
    (contains "\"--model\" \"${defaultModel}/SmolLM2-135M-Instruct.Q4_1.gguf\"" cpuSc.ExecStart)
    cpuSc.ExecStart
  )
  (check "cpu: settings rendered to the config file" (
    builtins.readFile configPath == "max-running = 16\nspeculative-algorithm = \"ngram\"\n"
  ) (builtins.readFile configPath))
  (check "cpu: start on boot" (cpuUnit.wantedBy == [ "multi-user.target" ]) cpuUnit.wantedBy)
  (check "cpu: after the network only" (cpuUnit.after == [ "network-online.target" ]) cpuUnit.after)
  (check "cpu: LimitMEMLOCK=infinity" (cpuSc.LimitMEMLOCK == "infinity") cpuSc.LimitMEMLOCK)
  (check "cpu: TimeoutStartSec 900" (cpuSc.TimeoutStartSec == 900) cpuSc.TimeoutStartSec)
  (check "cpu: restart with backoff"
    (
      cpuSc.Restart == "on-failure"
      && cpuSc.RestartSteps > 0
      && cpuSc.RestartMaxDelaySec > cpuSc.RestartSec
    )
    [
      cpuSc.Restart
      cpuSc.RestartSec
      cpuSc.RestartSteps
      cpuSc.RestartMaxDelaySec
    ]
  )
  (check "cpu: start limit" (cpuUnit.startLimitBurst == 5) cpuUnit.startLimitBurst)
  (check "cpu: watchdog" (cpuSc.WatchdogSec == 60) cpuSc.WatchdogSec)
  (check "cpu: DynamicUser with state and cache directories"
    (cpuSc.DynamicUser && cpuSc.StateDirectory == "kiln/dev" && cpuSc.CacheDirectory == "kiln/dev")
    [
      cpuSc.StateDirectory
      cpuSc.CacheDirectory
    ]
  )
  (check "cpu: no devices, no W^X exception"
    (cpuSc.PrivateDevices && cpuSc.MemoryDenyWriteExecute && cpuSc.DeviceAllow == [ ])
    [
      cpuSc.PrivateDevices
      cpuSc.DeviceAllow
    ]
  )
  (check "cpu: loopback only" (
    cpuSc.IPAddressDeny == "any" && cpuSc.IPAddressAllow == "localhost"
  ) cpuSc.IPAddressDeny)
  (check "cpu: hardening"
    (
      cpuSc.ProtectSystem == "strict"
      && cpuSc.DevicePolicy == "closed"
      && cpuSc.CapabilityBoundingSet == ""
      && cpuSc.NoNewPrivileges
    )
    [
      cpuSc.ProtectSystem
      cpuSc.DevicePolicy
    ]
  )
  (check "cpu: cache directory for kiln" (
    cpuUnit.environment.KILN_CACHE_DIR == "/var/cache/kiln/dev"
  ) cpuUnit.environment)
  (check "cpu: firewall closed" (
    cpu.networking.firewall.allowedTCPPorts == [ ]
  ) cpu.networking.firewall.allowedTCPPorts)

  (check "cpu: the tight syscall filter, no netlink" (
    cpuSc.SystemCallFilter == [
      "@system-service"
      "~@privileged @resources"
    ]
    && !(lib.elem "AF_NETLINK" cpuSc.RestrictAddressFamilies)
    && cpuSc.LimitCORE == 0
  ) cpuSc.SystemCallFilter)

  (check "gpu: no assertion fails" (failed gpu == [ ]) (failed gpu))
  (check "gpu: no warning" (gpu.warnings == [ ]) gpu.warnings)
  (check "gpu: ordered after nvidia-persistenced" (
    lib.elem "nvidia-persistenced.service" gpuUnit.after
    && lib.elem "nvidia-persistenced.service" gpuUnit.wants
  ) gpuUnit.after)
  (check "gpu: runs the lock, from the store, with the canary" (
    contains "\"--lock\" \"${builtins.storeDir}/" gpuSc.ExecStart
    && contains "-kiln-main.lock\" \"--canary\"" gpuSc.ExecStart
  ) gpuSc.ExecStart)
  (check "gpu: the lock is in the unit's closure (string context)" (lib.any (
    p: lib.hasSuffix "-kiln-main.lock" p
  ) lockStorePaths) lockStorePaths)
  (check "gpu: no settings flags beside the lock" (
    !(contains "--config" gpuSc.ExecStart) && !(contains "--host" gpuSc.ExecStart)
  ) gpuSc.ExecStart)
  (check "gpu: API key as a credential"
    (
      gpuSc.LoadCredential == [ "api-key:/run/secrets/kiln-api-key" ]
      && lib.hasSuffix " --api-key-file \${CREDENTIALS_DIRECTORY}/api-key" gpuSc.ExecStart
    )
    [
      gpuSc.LoadCredential
      gpuSc.ExecStart
    ]
  )
  (check "gpu: device nodes: control, uvm and its own eight GPUs" (
    !gpuSc.PrivateDevices
    && !gpuSc.MemoryDenyWriteExecute
    && lib.length gpuSc.DeviceAllow == 11
    && lib.elem "char-nvidia-uvm rw" gpuSc.DeviceAllow
    && lib.elem "/dev/nvidiactl rw" gpuSc.DeviceAllow
    && lib.elem "/dev/nvidia7 rw" gpuSc.DeviceAllow
    && !(lib.elem "char-nvidia-frontend rw" gpuSc.DeviceAllow)
  ) gpuSc.DeviceAllow)
  (check "gpu: PCI bus order, a JIT cache, NCCL bootstrap on loopback" (
    gpuUnit.environment.CUDA_DEVICE_ORDER == "PCI_BUS_ID"
    && gpuUnit.environment.CUDA_CACHE_PATH == "/var/cache/kiln/main/cuda-jit"
    && gpuUnit.environment.NCCL_SOCKET_IFNAME == "lo"
  ) gpuUnit.environment)
  (check "gpu: NCCL's syscalls and netlink with eight GPUs"
    (
      gpuSc.SystemCallFilter == [
        "@system-service"
        "~@privileged"
      ]
      && lib.elem "AF_NETLINK" gpuSc.RestrictAddressFamilies
    )
    [
      gpuSc.SystemCallFilter
      gpuSc.RestrictAddressFamilies
    ]
  )
  (check "gpu: no core dumps, many files, a chatty start kept"
    (gpuSc.LimitCORE == 0 && gpuSc.LimitNOFILE >= 65536 && gpuSc.LogRateLimitBurst >= 10000)
    [
      gpuSc.LimitCORE
      gpuSc.LimitNOFILE
      gpuSc.LogRateLimitBurst
    ]
  )
  (check "gpu: CUDA_VISIBLE_DEVICES" (
    gpuUnit.environment.CUDA_VISIBLE_DEVICES == "0,1,2,3,4,5,6,7"
  ) gpuUnit.environment)
  (check "gpu: the lock's environment plus typed NCCL options" (
    gpuUnit.environment.NCCL_P2P_LEVEL == "SYS"
    && gpuUnit.environment.NCCL_MIN_NCHANNELS == "8"
    && gpuUnit.environment.NCCL_IB_DISABLE == "1"
  ) gpuUnit.environment)
  (check "gpu: the lock's port in the firewall" (
    gpu.networking.firewall.allowedTCPPorts == [ 30000 ]
  ) gpu.networking.firewall.allowedTCPPorts)
  (check "gpu: not loopback-only" (!(gpuSc ? IPAddressDeny)) (gpuSc.IPAddressDeny or null))
  (check "gpu: stop timeout from the lock's shutdown-timeout" (
    gpuSc.TimeoutStopSec == 75
  ) gpuSc.TimeoutStopSec)

  (check "hosts/reference: no assertion fails" (failed reference == [ ]) (failed reference))
  (check "hosts/reference: the CUDA package on 8 GPUs after persistenced"
    (
      lib.hasPrefix "\"${kilnFlake.packages.x86_64-linux.cuda}/bin/kiln\"" referenceUnit.serviceConfig.ExecStart
      && referenceUnit.environment.CUDA_VISIBLE_DEVICES == "0,1,2,3,4,5,6,7"
      && lib.elem "nvidia-persistenced.service" referenceUnit.after
    )
    [
      referenceUnit.serviceConfig.ExecStart
      referenceUnit.after
    ]
  )
  (check "hosts/reference: NCCL tuning in the environment" (
    referenceUnit.environment.NCCL_P2P_LEVEL == "SYS" && referenceUnit.environment.NCCL_PROTO == "LL"
  ) referenceUnit.environment)
  (check "hosts/reference: Kimi-K2-Thinking over 8 GPUs with an EAGLE-3 head"
    (
      contains "\"--model\" \"/var/lib/kiln/models/Kimi-K2-Thinking\"" referenceUnit.serviceConfig.ExecStart
      && contains "tensor-parallel-size = 8\n" referenceConfig
      && contains "speculative-algorithm = \"eagle3\"\n" referenceConfig
      && contains "speculative-draft-model-path = \"/var/lib/kiln/models/Kimi-K2-Thinking-EAGLE3\"\n" referenceConfig
    )
    [
      referenceUnit.serviceConfig.ExecStart
      referenceConfig
    ]
  )
  (check "hosts/reference: ACS cleared before kiln starts"
    (lib.elem "kiln-main.service" reference.systemd.services.kiln-disable-acs.before)
    reference.systemd.services.kiln-disable-acs.before
  )
  (check "hosts/reference: port 30000 open" (
    reference.networking.firewall.allowedTCPPorts == [ 30000 ]
  ) reference.networking.firewall.allowedTCPPorts)
  (check "hosts/reference: warns until the lock is committed" (
    lib.pathExists ../../hosts/reference/kiln.lock || anyContains "no kiln.lock yet" reference.warnings
  ) reference.warnings)
  (check "hosts/cpu: the default model, loopback" (
    failed cpuHost == [ ]
    && contains "${defaultModel}/SmolLM2-135M-Instruct.Q4_1.gguf" cpuHostUnit.serviceConfig.ExecStart
    && cpuHostUnit.serviceConfig.IPAddressDeny == "any"
  ) cpuHostUnit.serviceConfig.ExecStart)

  (check "split: no assertion fails" (failed split == [ ]) (failed split))
  (check "split: each instance sees and may open only its own GPUs"
    (
      left.environment.CUDA_VISIBLE_DEVICES == "0,1,2,3"
      && right.environment.CUDA_VISIBLE_DEVICES == "4,5,6,7"
      && lib.elem "/dev/nvidia3 rw" left.serviceConfig.DeviceAllow
      && !(lib.elem "/dev/nvidia4 rw" left.serviceConfig.DeviceAllow)
      && lib.elem "/dev/nvidia4 rw" right.serviceConfig.DeviceAllow
      && !(lib.elem "/dev/nvidia0 rw" right.serviceConfig.DeviceAllow)
    )
    [
      left.serviceConfig.DeviceAllow
      right.serviceConfig.DeviceAllow
    ]
  )
  (check "split: loopback-only with NCCL's bootstrap on lo" (
    left.serviceConfig.IPAddressDeny == "any"
    && left.serviceConfig.IPAddressAllow == "localhost"
    && left.environment.NCCL_SOCKET_IFNAME == "lo"
  ) left.serviceConfig)
  (check "split: a model path as a string, never copied; an environment file" (
    contains "\"--model\" \"/var/lib/kiln/models/left\"" left.serviceConfig.ExecStart
    && left.serviceConfig.EnvironmentFile == [ "/run/secrets/kiln-left.env" ]
    && right.serviceConfig.EnvironmentFile == [ ]
  ) left.serviceConfig.EnvironmentFile)
  (check "secrets: an absolute path string is taken, a path literal is refused" (
    accepts "apiKeyFile" "/run/secrets/kiln-api-key"
    && !(accepts "apiKeyFile" ./gpu.lock)
    && accepts "environmentFile" "/run/secrets/kiln.env"
    && !(accepts "environmentFile" ./gpu.lock)
    && !(accepts "apiKeyFile" "relative/key")
  ) null)
  (check "models: a package or an absolute path string, never a path literal" (
    accepts "model" defaultModel
    && accepts "model" "/var/lib/kiln/models/m.gguf"
    && !(accepts "model" ./gpu.lock)
  ) null)
  (check "split: GPU units keep the NUMA system calls" (
    left.serviceConfig.SystemCallFilter == [
      "@system-service"
      "~@privileged"
    ]
  ) left.serviceConfig.SystemCallFilter)
  (check "hosts/reference: nvidia-smi on the unit's path for the start-up checks" (
    referenceUnit.path != [ ]
  ) referenceUnit.path)
  (check "skipModelHash reaches the command line" (contains "\"--skip-model-hash\""
    (eval {
      services.xserver.videoDrivers = [ "nvidia" ];
      services.kiln.instances.x = {
        lockFile = ./gpu.lock;
        gpus = lib.range 0 7;
        skipModelHash = true;
      };
    }).systemd.services.kiln-x.serviceConfig.ExecStart
  ) null)

  (expectFailure "lockAndSettings" "lockFile fixes the model and every setting")
  (expectFailure "firewallOnLoopback" "openFirewall is set but the instance binds 127.0.0.1")
  (expectFailure "gpusWithoutDriver" "the NVIDIA driver is not enabled")
  (expectFailure "ncclAgainstLock" "NCCL_P2P_LEVEL=PHB differ from the lock's environment (NCCL_P2P_LEVEL=SYS)")
  (expectFailure "samePort" "a (127.0.0.1:8000) and b (127.0.0.1:8000) both bind port 8000")
  (expectFailure "wildcardPort" "a (0.0.0.0:8000) and b (127.0.0.1:8000) both bind port 8000")
  (expectFailure "sharedGpu" "a and b share GPU(s) 1")
  (expectFailure "lockGpuCount" "the lock was measured on 8 GPU(s) but gpus lists 4")
  (expectFailure "oldDriver" "needs NVIDIA driver 580 or newer")
  (expectFailure "newerNvrtc" "ships NVRTC 13.1.80, whose PTX needs NVIDIA driver 590 or newer")
  (expectFailure "unknownNvrtc" "add it to minDriverForNvrtc")
  (expectFailure "secretInStore" "must lie outside the Nix store")
  (expectFailure "skipHashWithoutLock" "skipModelHash skips the lock's model hash check")
  (expectFailure "canaryWithoutLock" "canary and driftPolicy compare the machine with a lock")
  (expectFailure "hostInSettings" "not settings")
  (expectFailure "portAgainstLock" "host/port differ from the lock's")
]
