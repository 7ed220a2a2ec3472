# What every kiln host shares: x86_64, UEFI boot from disks labelled `nixos` and `boot` (label them
# so at install), SSH for the operators, and the NixOS release the flake pins.
#
# Operators: `kiln.operators.NAME = [ "ssh-ed25519 AAAA... NAME@laptop" ];` (in the host's file, or
# a host-local module) gives NAME a login with those keys and sudo (wheel). SSH takes keys only: no
# passwords, no root login. A host with no operator builds with a warning: nobody could log in to it.
{ config, lib, ... }:
{
  options.kiln.operators = lib.mkOption {
    type = lib.types.attrsOf (lib.types.listOf lib.types.str);
    default = { };
    example = {
      alice = [ "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI... alice@laptop" ];
    };
    description = "Operator accounts: name to SSH public keys. Each gets a login, sudo (wheel) and those keys.";
  };

  config = {
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
    services.openssh = {
      enable = true;
      settings = {
        PasswordAuthentication = false;
        KbdInteractiveAuthentication = false;
        PermitRootLogin = "no";
      };
    };
    users.users = lib.mapAttrs (_: keys: {
      isNormalUser = true;
      extraGroups = [ "wheel" ];
      openssh.authorizedKeys.keys = keys;
    }) config.kiln.operators;
    # Operators log in with keys and have no passwords: sudo asks for none.
    security.sudo.wheelNeedsPassword = false;
    warnings =
      lib.optional (!lib.any (keys: keys != [ ]) (lib.attrValues config.kiln.operators))
        "hosts: no operator with an SSH key, so nobody can log in; set kiln.operators.NAME = [ \"ssh-ed25519 ...\" ] (hosts/common.nix).";
    system.stateVersion = "26.05";
  };
}
