# A small CPU machine serving the default model: the development and test host (no GPU, no driver).
{ ... }:
{
  imports = [ ./kiln.nix ];

  nixpkgs.hostPlatform = "x86_64-linux";
  networking.hostName = "kiln-cpu";
  boot.loader.systemd-boot.enable = true;
  boot.loader.efi.canTouchEfiVariables = true;
  fileSystems."/" = {
    device = "/dev/disk/by-label/nixos";
    fsType = "ext4";
  };
  fileSystems."/boot" = {
    device = "/dev/disk/by-label/boot";
    fsType = "vfat";
  };
  services.openssh.enable = true;
  system.stateVersion = "26.05";
}
