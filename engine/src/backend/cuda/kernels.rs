//! kiln's CUDA kernels and their compilation.
//!
//! The kernels are CUDA C sources in `kernels/`, embedded in the binary and compiled with NVRTC
//! at first use for the device's own architecture (then cached by the backend). Why NVRTC and not
//! PTX built with nvcc at build time: the build needs no CUDA toolkit (crane, CI and `cargo build`
//! stay CUDA-free), one binary serves Hopper (sm_90) and Blackwell (sm_120) and whatever comes next
//! with native code for each, and NVRTC ships as one library beside the driver. The cost, ~40 ms
//! per source, is paid once per machine.
//!
//! [`compile`] also drives the CI check: every source through NVRTC to PTX for each target, then
//! `ptxas -v` to assemble it and report registers, shared memory and spills per kernel.

use std::path::Path;
use std::process::Command;

/// One kernel source and the entry points it defines.
pub struct KernelSource {
    pub file: &'static str,
    pub source: &'static str,
    pub entry_points: &'static [&'static str],
}

const COMMON: &str = include_str!("kernels/common.cuh");

pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "norm.cu",
        source: include_str!("kernels/norm.cu"),
        entry_points: &["kiln_add_rms_norm_bf16", "kiln_head_rms_norm_bf16"],
    },
    KernelSource {
        file: "rope.cu",
        source: include_str!("kernels/rope.cu"),
        entry_points: &["kiln_rope_bf16"],
    },
    KernelSource {
        file: "mlp.cu",
        source: include_str!("kernels/mlp.cu"),
        entry_points: &["kiln_silu_mul_bf16", "kiln_embed_bf16"],
    },
    KernelSource {
        file: "attention.cu",
        source: include_str!("kernels/attention.cu"),
        entry_points: &[
            "kiln_kv_write_bf16",
            "kiln_kv_move_bf16",
            "kiln_paged_attention_bf16",
            "kiln_attention_combine",
        ],
    },
    KernelSource {
        file: "moe.cu",
        source: include_str!("kernels/moe.cu"),
        entry_points: &[
            "kiln_moe_route",
            "kiln_moe_group",
            "kiln_moe_gather",
            "kiln_moe_combine",
        ],
    },
    KernelSource {
        file: "mla.cu",
        source: include_str!("kernels/mla.cu"),
        entry_points: &["kiln_mla_attention_bf16"],
    },
    KernelSource {
        file: "elementwise.cu",
        source: include_str!("kernels/elementwise.cu"),
        entry_points: &[
            "kiln_add_bias_bf16",
            "kiln_add_bf16",
            "kiln_copy_columns_bf16",
            "kiln_scale_columns_bf16",
            "kiln_gather_rows_bf16",
            "kiln_scatter_add_rows_bf16",
            "kiln_copy_head_columns_bf16",
        ],
    },
    KernelSource {
        file: "dequant.cu",
        source: include_str!("kernels/dequant.cu"),
        entry_points: &[
            "kiln_dequant_bf16",
            "kiln_dequant_f8_blocks_bf16",
            "kiln_packed_matmul_bf16",
            "kiln_head_matmul_bf16",
            "kiln_moe_matmul_bf16",
            "kiln_q4_0_to_rows",
            "kiln_dequant_q4_rows_bf16",
        ],
    },
    KernelSource {
        file: "packed_mma.cu",
        source: include_str!("kernels/packed_mma.cu"),
        entry_points: &[
            "kiln_packed_mma_bf16",
            "kiln_moe_mma_bf16",
            "kiln_mma_layout_check",
        ],
    },
    KernelSource {
        file: "allreduce.cu",
        source: include_str!("kernels/allreduce.cu"),
        entry_points: &["kiln_oneshot_allreduce_bf16"],
    },
    KernelSource {
        file: "sampling.cu",
        source: include_str!("kernels/sampling.cu"),
        entry_points: &[
            "kiln_sample_prepare",
            "kiln_sample_stats",
            "kiln_sample_penalties",
            "kiln_sample_draw",
        ],
    },
];

/// A GPU architecture kiln targets: the virtual architecture NVRTC compiles for and the real one
/// ptxas assembles for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub virtual_arch: &'static str,
    pub sm: &'static str,
}

/// Hopper (H100/H200, the lent device) and Blackwell RTX PRO 6000 (the reference box).
pub const TARGETS: &[Target] = &[
    Target {
        virtual_arch: "compute_90",
        sm: "sm_90",
    },
    Target {
        virtual_arch: "compute_120",
        sm: "sm_120",
    },
];

/// The full source NVRTC sees: the shared helpers, then the file.
pub fn full_source(k: &KernelSource) -> String {
    format!("{COMMON}\n#line 1 \"{}\"\n{}", k.file, k.source)
}

/// NVRTC to PTX for one target. The kernels include no headers; `include_dir` is for callers
/// that add their own.
pub fn compile_ptx(
    k: &KernelSource,
    target: Target,
    include_dir: Option<&Path>,
) -> Result<String, String> {
    // SAFETY: only probes dlopen; cudarc's loader would panic on a missing library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "NVRTC (libnvrtc.so.13) is not loadable: put the CUDA lib folder on LD_LIBRARY_PATH"
                .into(),
        );
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(target.virtual_arch),
        include_paths: include_dir
            .map(|d| d.display().to_string())
            .into_iter()
            .collect(),
        options: vec!["--std=c++17".into(), "-lineinfo".into()],
        name: Some(k.file.into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(full_source(k), opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            format!(
                "{} for {}: {}",
                k.file,
                target.virtual_arch,
                log.to_string_lossy()
            )
        }
        other => format!("{} for {}: {other:?}", k.file, target.virtual_arch),
    })?;
    Ok(ptx.to_src())
}

/// What ptxas reports for one kernel on one architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    pub kernel: String,
    pub sm: String,
    pub registers: u32,
    pub shared_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Parses `ptxas -v` output (its "Compiling entry function" / "Used N registers" lines).
pub fn parse_ptxas_verbose(text: &str, sm: &str) -> Vec<KernelResources> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.trim_end().ends_with(unit))
            .and_then(|part| {
                part.split_whitespace()
                    .rev()
                    .nth(unit.split_whitespace().count())
            })
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let mut out = Vec::new();
    let mut current: Option<KernelResources> = None;
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(done) = current.take() {
                out.push(done);
            }
            current = Some(KernelResources {
                kernel: rest.split('\'').next().unwrap_or_default().to_string(),
                sm: sm.to_string(),
                registers: 0,
                shared_bytes: 0,
                spill_stores: 0,
                spill_loads: 0,
            });
        } else if let Some(k) = current.as_mut() {
            if line.contains("bytes spill stores") {
                k.spill_stores = number_before(line, "bytes spill stores");
                k.spill_loads = number_before(line, "bytes spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                k.registers = line
                    .split("Used ")
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                k.shared_bytes = number_before(line, "bytes smem");
            }
        }
    }
    out.extend(current);
    out
}

/// Assembles `ptx` for `sm` with `ptxas -v`, returning the per-kernel resources.
pub fn assemble(
    ptxas: &Path,
    ptx: &str,
    sm: &str,
    work: &Path,
) -> Result<Vec<KernelResources>, String> {
    let input = work.join(format!("kernel-{sm}.ptx"));
    std::fs::write(&input, ptx).map_err(|e| format!("{}: {e}", input.display()))?;
    let output = Command::new(ptxas)
        .args(["-v", &format!("-arch={sm}"), "-o"])
        .arg(work.join(format!("kernel-{sm}.cubin")))
        .arg(&input)
        .output()
        .map_err(|e| format!("{}: {e}", ptxas.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if !output.status.success() {
        return Err(format!("ptxas -arch={sm} failed:\n{text}"));
    }
    Ok(parse_ptxas_verbose(&text, sm))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_verbose_output_is_parsed_per_kernel() {
        let text = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'kiln_rope_bf16' for 'sm_90'\n\
ptxas info    : Function properties for kiln_rope_bf16\n\
    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 18 registers, 1024 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'kiln_tree_mask' for 'sm_90'\n\
ptxas info    : Used 10 registers, 388 bytes cmem[0]\n";
        let r = parse_ptxas_verbose(text, "sm_90");
        assert_eq!(r.len(), 2);
        assert_eq!(
            (
                r[0].kernel.as_str(),
                r[0].registers,
                r[0].shared_bytes,
                r[0].spill_stores,
                r[0].spill_loads
            ),
            ("kiln_rope_bf16", 18, 1024, 8, 12)
        );
        assert_eq!(
            (r[1].kernel.as_str(), r[1].registers, r[1].shared_bytes),
            ("kiln_tree_mask", 10, 0)
        );
    }

    /// The CI check (`.ci/run` runs it with `--ignored`): every kernel through NVRTC and ptxas for
    /// Hopper and Blackwell, with each kernel's registers, shared memory and spills printed. Needs
    /// `KILN_CUDA_HOME`: a folder with `lib/libnvrtc.so.13` (on LD_LIBRARY_PATH) and
    /// `bin/ptxas` — the pip wheels' `nvidia/cu13`, or a CUDA toolkit.
    #[test]
    #[ignore = "needs NVRTC and ptxas (KILN_CUDA_HOME); CI runs it"]
    fn every_kernel_compiles_for_hopper_and_blackwell() {
        let home = std::env::var_os("KILN_CUDA_HOME")
            .map(std::path::PathBuf::from)
            .expect("set KILN_CUDA_HOME to a CUDA 13 folder with lib/ and bin/ptxas");
        let work = std::env::temp_dir().join(format!("kiln-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&work).expect("temp dir");
        println!(
            "{:<28} {:<7} {:>5} {:>7} {:>7} {:>7}",
            "kernel", "arch", "regs", "smem B", "spill S", "spill L"
        );
        let mut failures = Vec::new();
        let mut assembled = 0;
        for target in TARGETS {
            for k in SOURCES {
                let ptx = match compile_ptx(k, *target, None) {
                    Ok(p) => p,
                    Err(e) => {
                        failures.push(e);
                        continue;
                    }
                };
                match assemble(&home.join("bin/ptxas"), &ptx, target.sm, &work) {
                    Ok(resources) => {
                        assembled += 1;
                        let names: Vec<&str> =
                            resources.iter().map(|r| r.kernel.as_str()).collect();
                        for want in k.entry_points {
                            if !names.contains(want) {
                                failures.push(format!(
                                    "{}: entry point {want} missing for {}",
                                    k.file, target.sm
                                ));
                            }
                        }
                        for r in resources {
                            println!(
                                "{:<28} {:<7} {:>5} {:>7} {:>7} {:>7}",
                                r.kernel,
                                r.sm,
                                r.registers,
                                r.shared_bytes,
                                r.spill_stores,
                                r.spill_loads
                            );
                        }
                    }
                    Err(e) => failures.push(format!("{}: {e}", k.file)),
                }
            }
        }
        let _ = std::fs::remove_dir_all(&work);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        // A check that compiled nothing checked nothing.
        assert!(
            !SOURCES.is_empty() && !TARGETS.is_empty(),
            "no kernel sources or targets"
        );
        assert_eq!(
            assembled,
            SOURCES.len() * TARGETS.len(),
            "kernels assembled"
        );
        println!("{assembled} kernel sources assembled");
    }
}
