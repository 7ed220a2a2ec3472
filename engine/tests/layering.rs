//! Layers point down: the server and the CLI reach a backend through the runner (`--device`),
//! never by name, so a backend can change without either noticing.

use std::path::Path;

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_server_and_the_cli_name_no_backend() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for layer in ["server", "cli"] {
        sources(&root.join(layer), &mut files);
    }
    assert!(files.len() > 10, "found only {} files", files.len());
    let named: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("readable source");
            ["backend::cuda", "backend::cpu", "CudaBackend", "CpuBackend"]
                .iter()
                .filter(|n| text.contains(**n))
                .map(|n| format!("{} names {n}", f.display()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(named.is_empty(), "{named:#?}");
}
