//! An SGLang launch, as its operators wrote it (a shell line or script, a systemd unit), turned
//! into kiln's serve settings and the environment worth keeping. Every flag and variable gets a
//! verdict: mapped (to which kiln key), not needed (why), or not carried (what to do instead).
//! Anything not in these tables is refused by name: a guess would silently change a tuned setup.

use std::collections::BTreeMap;

/// What became of one flag or variable.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Carried as this kiln setting (a serve key) with this value.
    Mapped { key: String, value: toml::Value },
    /// Kept in the environment file as it is.
    Kept,
    /// kiln does not need it, and why.
    NotNeeded(&'static str),
    /// kiln cannot carry it; what to do instead.
    NotCarried(String),
}

/// One line of the report: the flag (`--tp 8`) or variable (`NCCL_P2P_LEVEL=SYS`) and its verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub given: String,
    pub verdict: Verdict,
}

/// The translation of a whole launch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Translation {
    /// kiln serve settings, keyed as `--config` files key them.
    pub settings: toml::Table,
    /// Variables to keep, in the order first given (the last value wins).
    pub env: Vec<(String, String)>,
    pub entries: Vec<Entry>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ImportError {
    #[error("no SGLang launch found (looked for `-m sglang.launch_server` or `sglang serve`)")]
    NoLaunch,
    #[error("the launch line does not parse as shell words: {0}")]
    Quoting(String),
    #[error("{0} has no value")]
    MissingValue(String),
    #[error("{flag}: {why}")]
    BadValue { flag: String, why: String },
    #[error(
        "not understood, so not guessed at (remove them or map them by hand): {}",
        .0.join(", ")
    )]
    Unknown(Vec<String>),
}

/// How a flag is carried.
enum Rule {
    /// To a kiln key, the value converted as `Kind` says.
    To(&'static str, Kind),
    NotNeeded(&'static str),
    NotCarried(&'static str),
}

#[derive(Clone, Copy)]
enum Kind {
    Text,
    Int,
    Float,
    /// A switch: present means true.
    Switch,
    /// SGLang's algorithm names to kiln's.
    Algorithm,
}

/// A flag's rule and whether it takes a value.
fn rule(flag: &str) -> Option<(Rule, bool)> {
    use Kind::*;
    use Rule::*;
    let r = match flag {
        "model-path" => (To("model", Text), true),
        "tp" | "tp-size" | "tensor-parallel-size" => (To("tensor-parallel-size", Int), true),
        "speculative-algorithm" => (To("speculative-algorithm", Algorithm), true),
        "speculative-draft-model-path" => (To("speculative-draft-model-path", Text), true),
        "speculative-num-steps" => (To("speculative-num-steps", Int), true),
        "speculative-eagle-topk" => (To("speculative-eagle-topk", Int), true),
        "speculative-num-draft-tokens" => (To("speculative-num-draft-tokens", Int), true),
        "mem-fraction-static" => (To("mem-fraction-static", Float), true),
        "served-model-name" => (To("served-model-name", Text), true),
        "tool-call-parser" => (To("tool-call-parser", Text), true),
        "reasoning-parser" => (To("reasoning-parser", Text), true),
        "host" => (To("host", Text), true),
        "port" => (To("port", Int), true),
        "cuda-graph-max-bs" => (To("cuda-graph-max-bs", Int), true),
        "disable-cuda-graph" => (To("disable-cuda-graph", Switch), false),
        "disable-overlap-schedule" => (To("disable-overlap-schedule", Switch), false),
        "disable-radix-cache" => (To("no-prefix-cache", Switch), false),
        "max-running-requests" => (To("max-running", Int), true),
        "context-length" => (To("max-model-len", Int), true),
        "chunked-prefill-size" => (To("max-step-tokens", Int), true),
        "trust-remote-code" => (NotNeeded("kiln runs no code from the checkpoint"), false),
        "enable-metrics" => (
            NotNeeded("kiln always serves Prometheus metrics at /metrics"),
            false,
        ),
        "skip-server-warmup" => (NotNeeded("kiln warms up before /ready says yes"), false),
        "enable-torch-compile" => (NotNeeded("kiln does not run PyTorch"), false),
        "torch-compile-max-bs" => (NotNeeded("kiln does not run PyTorch"), true),
        "attention-backend"
        | "sampling-backend"
        | "prefill-attention-backend"
        | "decode-attention-backend" => (NotNeeded("kiln has one set of kernels"), true),
        "disable-custom-all-reduce" => (
            NotNeeded("kiln's all-reduce is NCCL's (its tuning variables are kept)"),
            false,
        ),
        "enable-p2p-check" => (
            NotNeeded("`kiln doctor` checks peer-to-peer access at boot"),
            false,
        ),
        "watchdog-timeout" => (
            NotNeeded(
                "kiln's watchdog is systemd's (WatchdogSec; the NixOS module sets it); a stalled \
                 tensor-parallel rank fails its step after --tp-collective-timeout",
            ),
            true,
        ),
        "api-key" => (
            NotCarried(
                "a secret does not go into a config file: write it to a file only the service \
                 reads and pass --api-key-file (the NixOS module's apiKeyFile)",
            ),
            true,
        ),
        "log-level" | "log-level-http" => (
            NotCarried("kiln logs through tracing: set RUST_LOG (e.g. RUST_LOG=info)"),
            true,
        ),
        "tokenizer-path" => (
            NotCarried(
                "kiln reads the tokenizer beside the model: put its files in the model directory",
            ),
            true,
        ),
        "random-seed" => (
            NotCarried("kiln seeds per request (the `seed` field), not per server"),
            true,
        ),
        "dp" | "dp-size" | "data-parallel-size" => (
            NotCarried("kiln serves one replica per process: run one kiln per GPU group"),
            true,
        ),
        "nnodes" | "node-rank" | "dist-init-addr" => {
            (NotCarried("kiln serves within one machine"), true)
        }
        "kv-cache-dtype" => (
            NotCarried("kiln's GPU KV cache is bf16; an fp8 cache is not built"),
            true,
        ),
        _ => return None,
    };
    Some(r)
}

/// What to do with an environment variable.
fn env_rule(name: &str) -> Option<Verdict> {
    let not_needed = |why| Some(Verdict::NotNeeded(why));
    if name.starts_with("NCCL_") || name.starts_with("CUDA_") || name.starts_with("NVIDIA_") {
        return Some(Verdict::Kept);
    }
    match name {
        "SGLANG_ENABLE_SPEC_V2" => not_needed(
            "kiln has one speculative path (it plans each speculative step after the previous \
             step's tokens, see the README's overlap scheduling)",
        ),
        "PYTHONPATH" | "PYTHONUNBUFFERED" | "PYTHONHASHSEED" | "VIRTUAL_ENV" => {
            not_needed("kiln is not a Python program")
        }
        "HF_HOME"
        | "HF_HUB_OFFLINE"
        | "TRANSFORMERS_OFFLINE"
        | "HF_HUB_ENABLE_HF_TRANSFER"
        | "HF_TOKEN"
        | "HUGGING_FACE_HUB_TOKEN"
        | "TOKENIZERS_PARALLELISM" => {
            not_needed("kiln reads the model from its path and never fetches from the Hub")
        }
        "PYTORCH_CUDA_ALLOC_CONF" | "TORCH_CUDA_ARCH_LIST" | "TORCHINDUCTOR_CACHE_DIR" => {
            not_needed("kiln does not run PyTorch")
        }
        "OMP_NUM_THREADS" | "MKL_NUM_THREADS" => {
            not_needed("kiln sizes its own threads (--threads)")
        }
        "PATH" | "HOME" | "LANG" | "LC_ALL" | "TZ" | "LD_LIBRARY_PATH" => {
            not_needed("the service manager and kiln's package set these")
        }
        _ => None,
    }
}

/// A launch's words: the environment given before the command, and the arguments after it.
struct Launch {
    env: Vec<(String, String)>,
    args: Vec<String>,
    /// Lines reported as they are (a unit's `EnvironmentFile=`).
    notes: Vec<Entry>,
}

/// Finds the launch in `text`: a shell line or script (continuations, `export`, `env`), or a
/// systemd unit (`Environment=`, `ExecStart=`).
fn find_launch(text: &str) -> Result<Launch, ImportError> {
    let joined = text.replace("\\\r\n", " ").replace("\\\n", " ");
    // In a unit only `Environment=` and `ExecStart=` matter; its other directives are not
    // shell assignments.
    let unit = joined.lines().any(|l| {
        let l = l.trim();
        l == "[Service]" || l.starts_with("ExecStart=")
    });
    let mut env = Vec::new();
    let mut notes = Vec::new();
    let mut launch = None;
    for line in joined.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(file) = line.strip_prefix("EnvironmentFile=") {
            notes.push(Entry {
                given: line.to_string(),
                verdict: Verdict::NotCarried(format!(
                    "kiln import reads only this file: add the variables of {file} as \
                     Environment= lines and import again, or keep the file for kiln's unit"
                )),
            });
            continue;
        }
        // systemd: `Environment=A=1 "B=2 3"` and `ExecStart=...`.
        if let Some(rest) = line.strip_prefix("Environment=") {
            for w in words(rest)? {
                if let Some((k, v)) = assignment(&w) {
                    env.push((k, v));
                }
            }
            continue;
        }
        let line = match line.strip_prefix("ExecStart=") {
            Some(command) => command,
            None if unit => continue,
            None => line,
        };
        let mut ws = words(line)?;
        if ws.first().is_some_and(|w| w == "export") {
            ws.remove(0);
            env.extend(ws.iter().filter_map(|w| assignment(w)));
            continue;
        }
        // Leading assignments (`A=1 B=2 cmd`, `env A=1 cmd`, `exec cmd`).
        let mut at = 0;
        while at < ws.len() {
            let w = ws[at].as_str();
            if w == "exec" || w == "env" || w.ends_with("/env") {
                at += 1;
            } else if let Some(kv) = assignment(w) {
                env.push(kv);
                at += 1;
            } else {
                break;
            }
        }
        let rest = &ws[at..];
        let start = rest
            .windows(2)
            .position(|p| p[0] == "-m" && p[1] == "sglang.launch_server")
            .map(|i| i + 2)
            .or_else(|| {
                rest.windows(2)
                    .position(|p| p[0].ends_with("sglang") && p[1] == "serve")
                    .map(|i| i + 2)
            });
        // Other lines of a script (plain assignments, other commands) are not the launch.
        if let Some(i) = start {
            launch = Some(rest[i..].to_vec());
        }
    }
    let args = launch.ok_or(ImportError::NoLaunch)?;
    Ok(Launch { env, args, notes })
}

/// A value as the report prints it: secrets (the API key, variables named like tokens, keys,
/// secrets or passwords) hidden.
fn shown<'a>(name: &str, value: &'a str) -> &'a str {
    let upper = name.to_ascii_uppercase().replace('-', "_");
    let secret = upper == "API_KEY"
        || upper.ends_with("_TOKEN")
        || upper.ends_with("_KEY")
        || upper.contains("SECRET")
        || upper.contains("PASSWORD");
    if secret { "(hidden)" } else { value }
}

fn words(line: &str) -> Result<Vec<String>, ImportError> {
    shlex::split(line).ok_or_else(|| ImportError::Quoting(line.to_string()))
}

/// `NAME=value` with a shell variable name.
fn assignment(word: &str) -> Option<(String, String)> {
    let (k, v) = word.split_once('=')?;
    let valid = !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    valid.then(|| (k.to_string(), v.to_string()))
}

fn convert(flag: &str, kind: Kind, raw: &str) -> Result<toml::Value, ImportError> {
    let bad = |why: &str| ImportError::BadValue {
        flag: format!("--{flag} {raw}"),
        why: why.to_string(),
    };
    Ok(match kind {
        Kind::Text => toml::Value::String(raw.to_string()),
        Kind::Int => toml::Value::Integer(
            raw.parse::<u32>()
                .map_err(|_| bad("expected a whole number"))?
                .into(),
        ),
        Kind::Float => toml::Value::Float(
            raw.parse::<f64>()
                .ok()
                .filter(|f| f.is_finite())
                .ok_or_else(|| bad("expected a number"))?,
        ),
        Kind::Switch => toml::Value::Boolean(true),
        Kind::Algorithm => toml::Value::String(
            match raw.to_ascii_uppercase().as_str() {
                // kiln's EAGLE runs EAGLE-3 heads; an older head is refused when it loads.
                "EAGLE3" | "EAGLE" => "eagle3",
                "NGRAM" => "ngram",
                "NONE" => "none",
                _ => return Err(bad("kiln runs EAGLE3 (EAGLE), NGRAM or none")),
            }
            .to_string(),
        ),
    })
}

/// Translates an SGLang launch. Unknown flags and variables fail the whole translation, named.
pub fn translate(text: &str) -> Result<Translation, ImportError> {
    let launch = find_launch(text)?;
    let mut t = Translation::default();
    // SGLang serves on GPUs.
    t.settings
        .insert("device".into(), toml::Value::String("cuda".into()));
    let mut unknown = Vec::new();
    let mut kept: BTreeMap<String, usize> = BTreeMap::new();
    t.entries.extend(launch.notes);
    for (name, value) in launch.env {
        let given = format!("{name}={}", shown(&name, &value));
        match env_rule(&name) {
            None => unknown.push(given),
            Some(Verdict::Kept) => {
                match kept.get(&name) {
                    Some(&i) => t.env[i].1 = value,
                    None => {
                        kept.insert(name.clone(), t.env.len());
                        t.env.push((name, value));
                    }
                }
                t.entries.push(Entry {
                    given,
                    verdict: Verdict::Kept,
                });
            }
            Some(v) => t.entries.push(Entry { given, verdict: v }),
        }
    }
    let mut args = launch.args.into_iter();
    while let Some(word) = args.next() {
        let Some(flag) = word.strip_prefix("--") else {
            unknown.push(word);
            continue;
        };
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.replace('_', "-"), Some(v.to_string())),
            None => (flag.replace('_', "-"), None),
        };
        let Some((rule, takes_value)) = rule(&name) else {
            unknown.push(format!("--{name}"));
            continue;
        };
        let value = match (takes_value, inline) {
            (true, Some(v)) => Some(v),
            (true, None) => Some(
                args.next()
                    .ok_or_else(|| ImportError::MissingValue(format!("--{name}")))?,
            ),
            (false, _) => None,
        };
        let given = match &value {
            Some(v) => format!("--{name} {}", shown(&name, v)),
            None => format!("--{name}"),
        };
        let verdict = match rule {
            Rule::To(key, kind) => {
                let v = convert(&name, kind, value.as_deref().unwrap_or(""))?;
                t.settings.insert(key.to_string(), v.clone());
                Verdict::Mapped {
                    key: key.to_string(),
                    value: v,
                }
            }
            Rule::NotNeeded(why) => Verdict::NotNeeded(why),
            Rule::NotCarried(what) => Verdict::NotCarried(what.to_string()),
        };
        t.entries.push(Entry { given, verdict });
    }
    if !unknown.is_empty() {
        return Err(ImportError::Unknown(unknown));
    }
    Ok(t)
}

/// The report's line for one entry.
pub fn describe(e: &Entry) -> String {
    match &e.verdict {
        Verdict::Mapped { key, value } => format!("mapped      {}  ->  {key} = {value}", e.given),
        Verdict::Kept => format!("kept        {}  (environment file)", e.given),
        Verdict::NotNeeded(why) => format!("not needed  {}  ({why})", e.given),
        Verdict::NotCarried(what) => format!("NOT CARRIED {}  ({what})", e.given),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REFERENCE: &str = "SGLANG_ENABLE_SPEC_V2=True NCCL_P2P_LEVEL=SYS python -m \
        sglang.launch_server --model-path /models/kimi-k2 --tp 8 --speculative-algorithm EAGLE3 \
        --speculative-draft-model-path /models/kimi-k2-eagle3 --speculative-num-steps 3 \
        --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --mem-fraction-static 0.85 \
        --host 0.0.0.0 --port 30000 --trust-remote-code";

    fn setting<'a>(t: &'a Translation, key: &str) -> &'a toml::Value {
        t.settings
            .get(key)
            .unwrap_or_else(|| panic!("{key} missing"))
    }

    #[test]
    fn the_reference_line_maps_every_flag_and_keeps_nccl() {
        let t = translate(REFERENCE).expect("translates");
        assert_eq!(setting(&t, "model").as_str(), Some("/models/kimi-k2"));
        assert_eq!(setting(&t, "tensor-parallel-size").as_integer(), Some(8));
        assert_eq!(
            setting(&t, "speculative-algorithm").as_str(),
            Some("eagle3")
        );
        assert_eq!(
            setting(&t, "speculative-num-draft-tokens").as_integer(),
            Some(4)
        );
        assert_eq!(setting(&t, "mem-fraction-static").as_float(), Some(0.85));
        assert_eq!(setting(&t, "port").as_integer(), Some(30000));
        assert_eq!(setting(&t, "device").as_str(), Some("cuda"));
        assert_eq!(t.env, [("NCCL_P2P_LEVEL".into(), "SYS".into())]);
        let verdict = |given: &str| {
            t.entries
                .iter()
                .find(|e| e.given == given)
                .map(|e| e.verdict.clone())
                .unwrap_or_else(|| panic!("{given} not reported"))
        };
        assert!(matches!(
            verdict("SGLANG_ENABLE_SPEC_V2=True"),
            Verdict::NotNeeded(_)
        ));
        assert!(matches!(
            verdict("--trust-remote-code"),
            Verdict::NotNeeded(_)
        ));
        // Every flag and variable has its line.
        assert_eq!(t.entries.len(), 2 + 11);
    }

    #[test]
    fn a_systemd_unit_and_a_script_give_the_same_translation() {
        let unit = "[Unit]\nDescription=SGLang\n\n[Service]\n\
            Environment=SGLANG_ENABLE_SPEC_V2=True \"NCCL_P2P_LEVEL=SYS\"\n\
            Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID\n\
            ExecStart=/opt/venv/bin/python3 -m sglang.launch_server \\\n  --model-path=/models/kimi-k2 \\\n  \
            --tp-size 8 --speculative_algorithm eagle3 --host 0.0.0.0 --port 30000\n\
            Restart=always\n";
        let script = "#!/bin/sh\nexport NCCL_P2P_LEVEL=SYS CUDA_DEVICE_ORDER=PCI_BUS_ID\n\
            SGLANG_ENABLE_SPEC_V2=True\n\
            exec python3 -m sglang.launch_server --model-path /models/kimi-k2 --tp 8 \\\n  \
            --speculative-algorithm EAGLE3 --host 0.0.0.0 --port 30000\n";
        let (u, s) = (
            translate(unit).expect("unit"),
            translate(script).expect("script"),
        );
        assert_eq!(u.settings, s.settings);
        assert_eq!(
            u.env,
            [
                ("NCCL_P2P_LEVEL".to_string(), "SYS".to_string()),
                ("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string())
            ]
        );
        assert_eq!(u.env, s.env);
    }

    #[test]
    fn what_is_not_understood_is_refused_by_name() {
        let e = translate(
            "FOO_BAR=1 python -m sglang.launch_server --model-path /m --enable-dp-attention \
             --quantization fp8 stray",
        )
        .expect_err("refused");
        assert_eq!(
            e,
            ImportError::Unknown(vec![
                "FOO_BAR=1".into(),
                "--enable-dp-attention".into(),
                "--quantization".into(),
                "fp8".into(),
                "stray".into()
            ])
        );
        assert_eq!(
            translate("python -m sglang.launch_server --speculative-algorithm MEDUSA"),
            Err(ImportError::BadValue {
                flag: "--speculative-algorithm MEDUSA".into(),
                why: "kiln runs EAGLE3 (EAGLE), NGRAM or none".into()
            })
        );
        assert_eq!(
            translate("python -m sglang.launch_server --tp"),
            Err(ImportError::MissingValue("--tp".into()))
        );
        assert_eq!(
            translate("python serve.py --tp 8"),
            Err(ImportError::NoLaunch)
        );
    }

    #[test]
    fn secrets_and_logging_are_not_carried_and_say_what_to_do() {
        let t = translate("python -m sglang.launch_server --api-key s3cret --log-level info")
            .expect("translates");
        assert!(!t.settings.contains_key("api-key"));
        assert!(
            t.entries
                .iter()
                .all(|e| matches!(&e.verdict, Verdict::NotCarried(w) if !w.is_empty()))
        );
        let line = describe(&t.entries[0]);
        assert!(
            line.contains("--api-key-file") && !line.contains("s3cret"),
            "{line}"
        );
        let t = translate(
            "HF_TOKEN=hf_x python -m sglang.launch_server --speculative-num-draft-tokens 4",
        )
        .expect("translates");
        let lines: Vec<String> = t.entries.iter().map(describe).collect();
        assert!(!lines[0].contains("hf_x"), "{lines:?}");
        assert!(
            lines[1].contains("--speculative-num-draft-tokens 4"),
            "{lines:?}"
        );
    }
}
