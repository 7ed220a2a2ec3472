# What every kiln host shares: x86_64, UEFI boot from disks labelled `nixos` and `boot` (label them
# so at install), SSH for the operator, and the NixOS release the flake pins.
{ ... }:
{
  nixpkgs.hostPlatform = "x86_64-linux";
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
