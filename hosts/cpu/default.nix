# A small CPU machine serving the default model: the development and test host (no GPU, no driver).
{ ... }:
{
  imports = [
    ../common.nix
    ./kiln.nix
  ];
  networking.hostName = "kiln-cpu";
}
