# The offline evaluation harness shared by eval.nix and units.nix: the NixOS options the module
# writes to, declared as plain options (no nixpkgs package set is needed), fake packages, and
# `eval`, which evaluates a configuration with the module.
{ lib }:
let
  fakePackage =
    name: extra:
    {
      type = "derivation";
      inherit name;
      outPath = "/nix/store/00000000000000000000000000000000-${name}";
    }
    // extra;
  kiln = fakePackage "kiln" { };
  defaultModel = fakePackage "kiln-default-model" { modelFile = "SmolLM2-135M-Instruct.Q4_1.gguf"; };

  # The NixOS options the module sets or reads, declared loosely so the module's own logic is what runs.
  nixosStub =
    { lib, ... }:
    {
      options = {
        assertions = lib.mkOption {
          type = lib.types.listOf lib.types.unspecified;
          default = [ ];
        };
        warnings = lib.mkOption {
          type = lib.types.listOf lib.types.str;
          default = [ ];
        };
        systemd.services = lib.mkOption {
          type = lib.types.attrsOf lib.types.unspecified;
          default = { };
        };
        networking.firewall.allowedTCPPorts = lib.mkOption {
          type = lib.types.listOf lib.types.port;
          default = [ ];
        };
        services.xserver.videoDrivers = lib.mkOption {
          type = lib.types.listOf lib.types.str;
          default = [ ];
        };
        hardware.nvidia = lib.mkOption {
          default = { };
          type = lib.types.submodule {
            freeformType = lib.types.lazyAttrsOf lib.types.anything;
            options.datacenter.enable = lib.mkOption {
              type = lib.types.bool;
              default = false;
            };
            options.nvidiaPersistenced = lib.mkOption {
              type = lib.types.bool;
              default = false;
            };
          };
        };
      };
      config = {
        # Everything else a host sets (boot, fileSystems, ...) is accepted unchecked.
        _module.freeformType = lib.types.lazyAttrsOf lib.types.anything;
        _module.args.pkgs = {
          writeText = name: text: builtins.toFile name text;
          stdenv.hostPlatform.system = "x86_64-linux";
        };
        services.kiln.package = lib.mkDefault kiln;
        # What hosts/reference's driver option reads (`config.boot.kernelPackages.nvidiaPackages`).
        boot.kernelPackages.nvidiaPackages.stable = lib.mkDefault (
          fakePackage "nvidia-x11" { version = "580.95.05"; }
        );
      };
    };

  # The flake as the hosts see it (`kiln` in specialArgs): packages only.
  kilnFlake.packages.x86_64-linux = {
    default = kiln;
    cuda = fakePackage "kiln-cuda" {
      kilnCuda = true;
      nvrtcVersion = "13.0.88";
    };
    default-model = defaultModel;
  };
  eval =
    config:
    (lib.evalModules {
      specialArgs.kiln = kilnFlake;
      modules = [
        nixosStub
        ../default.nix
        config
      ];
    }).config;

  # The two units both checks look at: eval.nix asserts on their settings, units.nix hands them
  # to systemd-analyze.
  scenarios = {
    # A CPU instance with the default-model package, settings and its secrets.
    cpu = {
      services.kiln.instances.dev = {
        model = defaultModel;
        settings.max-running = 16;
        settings.speculative-algorithm = "ngram";
        apiKeyFile = "/run/secrets/kiln-api-key";
        environmentFile = "/run/secrets/kiln.env";
      };
    };
    # The reference shape: eight GPUs, a lock, an API key, an open port.
    gpu = {
      services.xserver.videoDrivers = [ "nvidia" ];
      hardware.nvidia.nvidiaPersistenced = true;
      services.kiln.instances.main = {
        lockFile = ./gpu.lock;
        gpus = lib.range 0 7;
        nccl.ibDisable = true;
        nccl.p2pLevel = "SYS";
        apiKeyFile = "/run/secrets/kiln-api-key";
        openFirewall = true;
        canary = true;
      };
    };
  };

  # The options of one instance, to ask their types directly.
  instanceOptions =
    (lib.evalModules {
      specialArgs.kiln = kilnFlake;
      modules = [
        nixosStub
        ../default.nix
      ];
    }).options.services.kiln.instances.type.getSubOptions
      [ "x" ];
in
{
  inherit
    scenarios
    instanceOptions
    fakePackage
    kiln
    defaultModel
    kilnFlake
    eval
    ;
}
