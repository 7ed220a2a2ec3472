#!/usr/bin/env bash
# The Nix side of CI, everything that runs without nixpkgs' package set (which cannot be had here):
#   1. every .nix file parses (nix-instantiate --parse) and is nixfmt-formatted (nixfmt_rs, from crates);
#   2. the NixOS module and both hosts evaluate against the real nixpkgs lib, and their units,
#      environments, firewall and assertions are what nixos-module/tests/eval.nix says; a CPU and
#      an 8-GPU unit, rendered by nixos-module/tests/units.nix (a stand-in for NixOS's renderer),
#      pass `systemd-analyze verify` and score an exposure of at most 2.0 in `security`;
#   3. flake.lock resolves: crane's pinned narHash matches its source, and the flake's outputs list;
#   4. every patch in patches/series has the policy header and applies to its pinned upstream source.
# `nix flake check` (crane builds, clippy, nextest, the NixOS VM test) needs a Nix host: see README.
#
# Sources for the lib and crane: $NIXPKGS_LIB_SRC / $CRANE_SRC (a directory, a checkout or a bare git
# mirror), else ../shared/vendor/{nixpkgs-lib,crane} beside the checkout (there on every developer
# machine and in CI). A missing source fails its step: nothing here skips.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${KILN_CI_CACHE:-$HOME/.cache/kiln-ci}
mkdir -p "$CACHE"
fail=0

NIXBIN=$(bash .ci/install-nix.sh "$CACHE/nix" | tail -n1)
STORE="$CACHE/store"   # a private store: no daemon, no /nix needed
nix() { "$NIXBIN/nix" --store "$STORE" "$@"; }
nix_instantiate() { "$NIXBIN/nix-instantiate" --store "$STORE" "$@"; }

if ! [ -x "$CACHE/nixfmt/bin/nixfmt" ]; then
  cargo install --quiet nixfmt_rs --version 0.5.3 --locked --root "$CACHE/nixfmt"
fi
NIXFMT="$CACHE/nixfmt/bin/nixfmt"

echo "== nix: parse and format"
mapfile -t NIXFILES < <(git ls-files '*.nix')
[ ${#NIXFILES[@]} -gt 0 ] || { echo "no .nix file found (not a git checkout?)"; fail=1; }
for f in "${NIXFILES[@]}"; do
  nix_instantiate --parse "$f" >/dev/null || { echo "does not parse: $f"; fail=1; }
  "$NIXFMT" --check "$f" >/dev/null 2>&1 || { echo "not nixfmt-formatted: $f (run: nixfmt $f)"; fail=1; }
done
echo "${#NIXFILES[@]} files"

# A source tree from a directory or a bare git mirror, exported into $2.
export_tree() {
  local src=$1 dest=$2
  rm -rf "$dest"; mkdir -p "$dest"
  if [ -f "$src/HEAD" ] && [ -d "$src/objects" ]; then git -C "$src" archive HEAD | tar -x -C "$dest"
  else cp -r "$src/." "$dest/"; rm -rf "$dest/.git"; chmod -R u+w "$dest"; fi
}

LIB_SRC=${NIXPKGS_LIB_SRC:-../shared/vendor/nixpkgs-lib}
if [ -e "$LIB_SRC" ]; then
  export_tree "$LIB_SRC" "$CACHE/nixpkgs-lib"
  echo "== nix: module and hosts against nixpkgs lib ($(cd "$CACHE/nixpkgs-lib" && nix_instantiate --eval -E '(import ./lib).version' 2>/dev/null))"
  nix_instantiate --read-write-mode --eval --strict --json nixos-module/tests/eval.nix \
      --arg lib "import $CACHE/nixpkgs-lib/lib" > "$CACHE/eval.json"
  python3 - "$CACHE/eval.json" <<'PY' || fail=1
import json, sys
checks = json.load(open(sys.argv[1]))
bad = [c for c in checks if not c["ok"]]
for c in checks:
    print(("ok   " if c["ok"] else "FAIL ") + c["name"] + ("" if c["ok"] else "  got: " + json.dumps(c["got"])[:400]))
print(f"{len(checks)} checks, {len(bad)} failed")
sys.exit(1 if bad or not checks else 0)
PY
  echo "== nix: the module's units through systemd-analyze verify and security"
  # units.nix renders them with a stand-in for NixOS's unit renderer (which needs the package set).
  command -v systemd-analyze >/dev/null || { echo "systemd-analyze is required (Debian: systemd)"; exit 1; }
  nix_instantiate --read-write-mode --eval --strict --json nixos-module/tests/units.nix \
      --arg lib "import $CACHE/nixpkgs-lib/lib" > "$CACHE/units.json" || fail=1
  python3 - "$CACHE/units.json" "$CACHE/units" <<'PY' || fail=1
import json, os, re, shutil, subprocess, sys
units = json.load(open(sys.argv[1]))
out = sys.argv[2]
shutil.rmtree(out, ignore_errors=True)
os.makedirs(os.path.join(out, "pkg", "bin"))
# The fake package's store path becomes a folder holding an executable `kiln`, so verify finds it.
exe = os.path.join(out, "pkg", "bin", "kiln")
shutil.copy(shutil.which("true"), exe)
bad = 0
if not units:
    print("FAIL no unit rendered"); bad = 1
for name, text in sorted(units.items()):
    text = re.sub(r"/nix/store/0{32}-kiln(-cuda)?", os.path.join(out, "pkg"), text)
    path = os.path.join(out, name)
    open(path, "w").write(text)
    v = subprocess.run(["systemd-analyze", "verify", path], capture_output=True, text=True)
    if v.returncode:
        print(f"FAIL {name}: systemd-analyze verify\n{v.stdout}{v.stderr}"); bad = 1
        continue
    s = subprocess.run(["systemd-analyze", "security", "--offline=true", path], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", s.stdout)
    if not m:
        print(f"FAIL {name}: no exposure score\n{s.stdout}{s.stderr}"); bad = 1
        continue
    score = float(m.group(1))
    print(("ok  " if score <= 2.0 else "FAIL") + f" {name}: verify passes, exposure {score}")
    bad |= score > 2.0
sys.exit(bad)
PY
else
  echo "== nix: FAILED module evaluation: no nixpkgs lib at $LIB_SRC (set NIXPKGS_LIB_SRC)"
  fail=1
fi

CRANE_SRC=${CRANE_SRC:-../shared/vendor/crane}
if [ -e "$CRANE_SRC" ] && [ -e "$LIB_SRC" ]; then
  echo "== nix: flake.lock and outputs"
  export_tree "$CRANE_SRC" "$CACHE/crane"
  # A copy made without symlink support keeps each symlink as a small file holding its target
  # (crane's docs/CHANGELOG.md, docs/README.md): make them links again, or the tree is not the
  # pinned one. Only a one-line relative path to a file that exists in the tree is taken back.
  python3 - "$CACHE/crane" <<'PY'
import os, sys
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        p = os.path.join(d, f)
        if os.path.islink(p) or os.path.getsize(p) > 255:
            continue
        t = open(p, "rb").read()
        if not t or b"\n" in t or b"\0" in t or t.startswith(b"/"):
            continue
        target = t.decode("utf-8", "replace")
        if os.path.isfile(os.path.join(d, target)):
            os.remove(p)
            os.symlink(target, p)
PY
  want=$(python3 -c "import json;print(json.load(open('flake.lock'))['nodes']['crane']['locked']['narHash'])")
  got=$(nix hash path "$CACHE/crane")
  if [ "$want" = "$got" ]; then
    # With the source in the store under its narHash, the committed github pin resolves offline.
    nix store add-path --name source "$CACHE/crane" >/dev/null
    echo "crane pin ok ($got)"
  else
    # The pin is checked, never overridden: the flake must evaluate with the crane it names.
    echo "FAIL crane source $CRANE_SRC is not the revision flake.lock pins ($got, pinned $want)"
    fail=1
  fi
  # No package set can be had here: nixpkgs is nixpkgs' lib (a snapshot, not the pinned tree).
  OVR=(--override-input nixpkgs "path:$CACHE/nixpkgs-lib")
  : > "$CACHE/flake-eval.log"
  feval() { nix "$@" 2>>"$CACHE/flake-eval.log" || { echo "failed: nix $* (log: $CACHE/flake-eval.log)"; tail -n 20 "$CACHE/flake-eval.log"; return 1; }; }
  feval flake metadata "${OVR[@]}" . >/dev/null || fail=1
  for out in packages.x86_64-linux apps.x86_64-linux checks.x86_64-linux devShells.x86_64-linux nixosConfigurations; do
    printf '%s: ' "$out"
    feval eval --json "${OVR[@]}" ".#$out" --apply builtins.attrNames || fail=1
  done
  [ "$(feval eval "${OVR[@]}" .#nixosModules.default --apply builtins.isFunction)" = true ] || { echo "nixosModules.default is not a module function"; fail=1; }
else
  echo "== nix: FAILED flake evaluation: no crane source at $CRANE_SRC or no nixpkgs lib (set CRANE_SRC)"
  fail=1
fi

echo "== patches: header and a clean apply"
cargo fetch --quiet
[ -f patches/series ] || { echo "patches/series is missing"; exit 1; }
mapfile -t SERIES < <(grep -v -E '^\s*(#|$)' patches/series || true)
echo "${#SERIES[@]} patches in the series"
for p in "${SERIES[@]}"; do
  f="patches/$p"
  [ -f "$f" ] || { echo "patches/series lists $p, which does not exist"; fail=1; continue; }
  for field in "Subject:" "What:" "Why:" "Upstream:" "Applies to:" "Drop when:"; do
    grep -q "^$field" "$f" || { echo "$p: header lacks \`$field\` (patches/README.md)"; fail=1; }
  done
  case "$p" in
    crates/*)
      crate=$(echo "$p" | cut -d/ -f2); name=${crate%-*}; version=${crate##*-}
      grep -A1 "^name = \"$name\"$" Cargo.lock | grep -q "^version = \"$version\"$" \
        || { echo "$p: Cargo.lock does not pin $name $version"; fail=1; continue; }
      archive=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate.crate" 2>/dev/null | head -n1)
      [ -n "$archive" ] || { echo "$p: $crate.crate not in cargo's cache after cargo fetch"; fail=1; continue; }
      tree="$CACHE/patch-check/$crate"; rm -rf "$tree"; mkdir -p "$tree"
      tar -xzf "$archive" -C "$tree" --strip-components=1
      if (cd "$tree" && git apply --check "$OLDPWD/$f"); then echo "ok   $p"; else echo "FAIL $p does not apply to $name $version"; fail=1; fi
      ;;
    *) echo "$p: unknown target (only crates/NAME-VERSION/ is defined)"; fail=1 ;;
  esac
done

exit $fail
