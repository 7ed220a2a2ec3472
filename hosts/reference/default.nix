# The reference host: 8x NVIDIA RTX PRO 6000 Blackwell over PCIe (no NVLink), serving one large model
# with tensor parallelism across all eight GPUs.
#
# Bring-up: install NixOS with this configuration (without kiln.lock the instance runs the settings
# below), run the sweep on the box (`kiln bench sweep`, see the README), `kiln lock create`, commit
# the lock as hosts/reference/kiln.lock, `nixos-rebuild switch --flake .#reference`. From then on
# the service runs exactly the lock and its start-up checks report drift from it.
{
  config,
  lib,
  pkgs,
  kiln,
  ...
}:
let
  lockFile = ./kiln.lock;
  locked = builtins.pathExists lockFile;
in
{
  imports = [ ../common.nix ];
  # The NVIDIA driver (and, in kiln's CUDA package, CUDA and NCCL) are unfree.
  nixpkgs.config.allowUnfree = true;
  # Unfree packages are not on cache.nixos.org, so without another cache the first build compiles
  # NCCL and patches CUDA locally (an hour or more). Flox's cache serves nixpkgs' own CUDA builds
  # (announced with NVIDIA's redistribution agreement, 2025); it is checked after cache.nixos.org.
  nix.settings = {
    extra-substituters = [ "https://cache.flox.dev" ];
    extra-trusted-public-keys = [ "flox-cache-public-1:7F4OyH7ZCnFhcze3fJdfyXYLQw/aV7GEed86nQ7IsOs=" ];
  };
  networking.hostName = "kiln-reference";

  # The driver: the open kernel modules (required for Blackwell), persistence mode so the GPUs stay
  # initialised between processes (kiln-main orders after nvidia-persistenced.service), and the
  # graphics stack only for /run/opengl-driver/lib, where the service finds libcuda. kiln's CUDA
  # package is CUDA 13.0, which needs driver 580 or newer (the module asserts it).
  services.xserver.videoDrivers = [ "nvidia" ];
  hardware.graphics.enable = true;
  hardware.nvidia = {
    open = true;
    package = config.boot.kernelPackages.nvidiaPackages.stable;
    nvidiaPersistenced = true;
    modesetting.enable = false;
  };

  # Peer-to-peer between GPUs over PCIe. With the IOMMU translating DMA, P2P transfers either fail or
  # crawl through the root complex: `iommu=pt` passes device DMA through. PCIe Access Control Services
  # on the switches' downstream ports redirect P2P upstream too, and NCCL hangs or falls back to
  # copies through host memory; kiln-disable-acs below clears ACS on every bridge at boot (NVIDIA's
  # NCCL troubleshooting guide gives the same setpci loop). `kiln doctor` checks both.
  boot.kernelParams = [
    "iommu=pt"
  ];
  systemd.services.kiln-disable-acs = {
    description = "Disable PCIe ACS on bridges for GPU peer-to-peer";
    wantedBy = [ "multi-user.target" ];
    before = [ "kiln-main.service" ];
    requiredBy = [ "kiln-main.service" ];
    serviceConfig = {
      Type = "oneshot";
      RemainAfterExit = true;
    };
    path = [ pkgs.pciutils ];
    script = ''
      for bdf in $(lspci -D | awk '{print $1}'); do
        # Only devices with the ACS extended capability; clear its control register.
        if setpci -s "$bdf" ECAP_ACS+0x6.w >/dev/null 2>&1; then
          setpci -s "$bdf" ECAP_ACS+0x6.w=0000
        fi
      done
    '';
  };

  services.kiln.package = kiln.packages.x86_64-linux.cuda;
  services.kiln.instances.main = {
    gpus = lib.range 0 7;
    apiKeyFile = "/run/secrets/kiln-api-key";
    openFirewall = true;
    startTimeout = 1800;
  }
  // (
    if locked then
      {
        inherit lockFile;
        canary = true;
        driftPolicy = "warn";
      }
    else
      {
        host = "0.0.0.0";
        port = 30000;
        # Kimi-K2-Thinking as Moonshot ships it: routed experts in compressed-tensors INT4 (group
        # 32), the rest bf16, tiktoken.model; kiln keeps the INT4 packed (about 594 GB, 74 GB per
        # GPU at tensor parallelism 8, experts split expert-parallel).
        model = "/var/lib/kiln/models/Kimi-K2-Thinking";
        # PCIe-only RTX PRO 6000 boxes: P2P across root ports, more channels, the low-latency
        # protocol for small decode all-reduces, no InfiniBand probe. Without tuning the reference's
        # baseline fell from ~89 to ~63 tok/s. The sweep measures these; the lock freezes them.
        nccl = {
          p2pLevel = "SYS";
          minNChannels = 8;
          proto = "LL";
          ibDisable = true;
        };
        settings = {
          device = "cuda";
          tensor-parallel-size = 8;
          # The weights take ~74 GB of each 96 GB GPU; the KV pool (one MLA latent per token and
          # layer, 70 KB per token) gets the rest of this fraction.
          mem-fraction-static = 0.9;
          # An EAGLE-3 head for Kimi-K2 in SGLang's layout (LlamaForCausalLMEagle3: fc, midlayer,
          # norm, lm_head over a draft vocabulary with d2t), chain drafts of 3 (tree speculation
          # runs at tensor parallelism 1 only); the adaptive policy turns drafting down under load.
          speculative-algorithm = "eagle3";
          speculative-draft-model-path = "/var/lib/kiln/models/Kimi-K2-Thinking-EAGLE3";
          speculative-num-steps = 3;
          speculative-eagle-topk = 1;
          speculative-policy = "adaptive";
          max-running = 128;
          # NCCL only until the sweep measures the one-shot kernel against it on this box (the
          # lock then records the crossover, typically tens of KiB over PCIe).
          one-shot-allreduce-max-bytes = 0;
        };
      }
  );

  warnings =
    lib.optional (!locked)
      "hosts/reference: no kiln.lock yet, so kiln-main runs the unlocked settings; run the sweep on this box, then `kiln lock create` and commit the lock as hosts/reference/kiln.lock.";
}
