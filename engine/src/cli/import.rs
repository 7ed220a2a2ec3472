//! `kiln import sglang LAUNCH`: an SGLang launch (a shell line or script, or a systemd unit)
//! becomes a kiln config file, the environment worth keeping, and a one-config sweep, with a
//! verdict printed for every flag and variable (`kiln::migrate::sglang`).

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::Context;
use kiln::migrate::sglang::{self, Verdict};

use super::serve::from_table;

#[derive(clap::Args)]
pub struct ImportArgs {
    #[command(subcommand)]
    from: ImportFrom,
}

#[derive(clap::Subcommand)]
enum ImportFrom {
    /// An SGLang launch: `python -m sglang.launch_server ...` with its environment, as a shell
    /// line or script or as a systemd unit (`Environment=`, `ExecStart=`). Flags and variables
    /// kiln does not know are refused by name.
    Sglang(SglangArgs),
}

#[derive(clap::Args)]
struct SglangArgs {
    /// The file holding the launch ("-": standard input).
    launch: PathBuf,
    /// The kiln config to write (`kiln serve --config FILE`).
    #[arg(short, long, default_value = "kiln.toml")]
    out: PathBuf,
    /// The environment to keep (NCCL_*, CUDA_*), as KEY=VALUE lines (a systemd
    /// EnvironmentFile) [default: kiln.env beside the config].
    #[arg(long)]
    env_out: Option<PathBuf>,
    /// A sweep with the imported config as its one entry (`kiln bench sweep FILE`, then
    /// `kiln lock create --choose sglang-import`) [default: kiln-sweep.toml beside the config].
    #[arg(long)]
    sweep_out: Option<PathBuf>,
    /// Overwrite files that exist.
    #[arg(long)]
    force: bool,
}

/// The sweep entry's name.
const SWEEP_NAME: &str = "sglang-import";

pub fn run(a: ImportArgs) -> anyhow::Result<()> {
    match a.from {
        ImportFrom::Sglang(a) => sglang_import(a),
    }
}

fn sglang_import(a: SglangArgs) -> anyhow::Result<()> {
    let shown = a.launch.display().to_string();
    let text = if a.launch.as_os_str() == "-" {
        let mut t = String::new();
        std::io::stdin()
            .read_to_string(&mut t)
            .context("reading the launch from standard input")?;
        t
    } else {
        std::fs::read_to_string(&a.launch).with_context(|| format!("reading {shown}"))?
    };
    let t = sglang::translate(&text).map_err(|e| anyhow::anyhow!("{shown}: {e}"))?;
    // The settings must be ones `kiln serve --config` takes, with valid values.
    from_table(&t.settings, &format!("the config imported from {shown}"))?;

    let beside = |name: &str| a.out.with_file_name(name);
    let env_out = a.env_out.clone().unwrap_or_else(|| beside("kiln.env"));
    let sweep_out = a
        .sweep_out
        .clone()
        .unwrap_or_else(|| beside("kiln-sweep.toml"));
    for p in [&a.out, &env_out, &sweep_out] {
        anyhow::ensure!(
            a.force || !p.exists(),
            "{} exists (--force overwrites it)",
            p.display()
        );
    }

    for e in &t.entries {
        println!("{}", sglang::describe(e));
    }
    let settings = toml::to_string(&t.settings).context("rendering the config")?;
    write(
        &a.out,
        &format!(
            "# Imported from {shown} by `kiln import sglang`: run `kiln serve --config {}`\n\
             # with the environment in {}.\n{settings}",
            a.out.display(),
            env_out.display()
        ),
    )?;
    let env: String = t
        .env
        .iter()
        .map(|(k, v)| format!("{k}={}\n", env_value(v)))
        .collect();
    write(
        &env_out,
        &format!("# The environment kept from {shown} (systemd EnvironmentFile format).\n{env}"),
    )?;
    write(
        &sweep_out,
        &format!(
            "# `kiln bench sweep {sweep}` (with the variables of {env} exported), then\n\
             # `kiln lock create --from sweep.json --choose {SWEEP_NAME}`.\n\
             [bench]\nconcurrency = [1, 30, 100]\nmax-tokens = 200\n\n[serve]\n{settings}\n\
             [[config]]\nname = \"{SWEEP_NAME}\"\n",
            sweep = sweep_out.display(),
            env = env_out.display(),
        ),
    )?;
    let not_carried = t
        .entries
        .iter()
        .filter(|e| matches!(e.verdict, Verdict::NotCarried(_)))
        .count();
    println!(
        "wrote {} ({} settings), {} ({} variables), {}{}",
        a.out.display(),
        t.settings.len(),
        env_out.display(),
        t.env.len(),
        sweep_out.display(),
        if not_carried > 0 {
            format!("; {not_carried} not carried (see NOT CARRIED above)")
        } else {
            String::new()
        }
    );
    Ok(())
}

/// A value as an EnvironmentFile line holds it: quoted when it has spaces or quotes.
fn env_value(v: &str) -> String {
    if v.chars()
        .any(|c| c.is_whitespace() || c == '"' || c == '\'' || c == '\\')
    {
        format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
    } else {
        v.to_string()
    }
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
