//! `kiln doc FILE.lock`: the production document, generated from the lock.

use std::path::PathBuf;

use anyhow::Context;
use kiln::lock::Lock;

#[derive(clap::Args)]
pub struct DocArgs {
    /// The lock (from `kiln lock create`).
    lock: PathBuf,
    /// Where to write the document.
    #[arg(long, short, default_value = "production.md")]
    output: PathBuf,
    /// The service's instance name, as `kiln systemd-unit --name` (unit kiln-NAME.service).
    #[arg(long, default_value = "default")]
    instance: String,
    /// The upstream patch series to describe [default: the patches/ directory beside the lock's
    /// build, if present].
    #[arg(long)]
    patches: Option<PathBuf>,
}

pub fn run(a: DocArgs) -> anyhow::Result<()> {
    let lock = Lock::read(&a.lock).map_err(|e| anyhow::anyhow!(e))?;
    let patches_dir = a.patches.clone().or_else(|| {
        let p = PathBuf::from("patches");
        p.is_dir().then_some(p)
    });
    let patches = match &patches_dir {
        Some(d) => kiln::doc::read_patches(d).map_err(|e| anyhow::anyhow!(e))?,
        None => Vec::new(),
    };
    let text = kiln::doc::render(&lock, &a.lock.display().to_string(), &a.instance, &patches)
        .map_err(|e| anyhow::anyhow!(e))?;
    std::fs::write(&a.output, text).with_context(|| format!("writing {}", a.output.display()))?;
    eprintln!("kiln doc: wrote {}", a.output.display());
    Ok(())
}
