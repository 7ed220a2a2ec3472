# The CPU host's kiln instance: the default model on the CPU build, loopback only. The VM test boots
# exactly this (nixos-module/tests/vm.nix).
{ pkgs, kiln, ... }:
{
  services.kiln.instances.default = {
    model = kiln.packages.${pkgs.stdenv.hostPlatform.system}.default-model;
    settings = {
      max-running = 16;
      kv-tokens = 8192;
    };
  };
}
