# The module's units as files, for `systemd-analyze verify` and `security` (.ci/nix-checks.sh).
# NixOS renders `systemd.services.<name>` through nixos/lib/systemd-lib.nix, which needs the package
# set; `render` below is a stand-in for it that writes the same directives the same way (a list is
# one line per item, booleans are true/false, the environment is quoted `Environment=` lines), so
# what systemd checks is what the module asked for, not NixOS's own renderer.
#
#   nix-instantiate --eval --strict --json nixos-module/tests/units.nix --arg lib 'import <nixpkgs.lib>/lib'
#
# Result: { "<file name>.service" = "<unit text>"; ... } for a CPU instance and an 8-GPU one.
{ lib }:
let
  inherit (import ./harness.nix { inherit lib; }) scenarios eval;

  value = v: if builtins.isBool v then lib.boolToString v else toString v;
  lines = key: v: map (x: "${key}=${value x}") (lib.toList v);
  section =
    name: attrs:
    "[${name}]\n"
    + lib.concatStrings (
      lib.concatLists (
        lib.mapAttrsToList (k: v: map (l: l + "\n") (lines k v)) (lib.filterAttrs (_: v: v != null) attrs)
      )
    );
  render =
    u:
    section "Unit" ({
      Description = u.description;
      Documentation = u.documentation;
      After = lib.concatStringsSep " " u.after;
      Wants = lib.concatStringsSep " " u.wants;
      StartLimitIntervalSec = u.startLimitIntervalSec;
      StartLimitBurst = u.startLimitBurst;
    })
    + "\n"
    + section "Service" (
      {
        Environment =
          lib.mapAttrsToList (k: v: builtins.toJSON "${k}=${v}") u.environment
          ++ lib.optional (u.path or [ ] != [ ]) (builtins.toJSON "PATH=${lib.makeBinPath u.path}");
      }
      // u.serviceConfig
    )
    + "\n"
    + section "Install" { WantedBy = u.wantedBy; };

  cpu = eval scenarios.cpu;
  gpu = eval scenarios.gpu;
in
{
  "kiln-dev.service" = render cpu.systemd.services.kiln-dev;
  "kiln-main.service" = render gpu.systemd.services.kiln-main;
}
