//! Picking one `.gguf` of a GGUF repository: by file name (`--gguf-file`) or by quantization (`org/name:Q4_1`).
use crate::error::{ModelError, Result};
use std::fmt;

/// Which `.gguf` file of a repository to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GgufChoice {
    /// Exactly this file (its path in the repository).
    File(String),
    /// The one file whose name contains this quantization name, case-insensitively (`q4_1`, `Q8_0`).
    Quant(String),
}

impl fmt::Display for GgufChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufChoice::File(name) => write!(f, "--gguf-file {name}"),
            GgufChoice::Quant(q) => write!(f, "quantization {q}"),
        }
    }
}

/// The file of `ggufs` that `choice` names; with no choice, the only one. An error lists the choices when none
/// or several match.
pub(crate) fn pick_gguf<'a>(
    repo: &str,
    ggufs: &[&'a str],
    choice: Option<&GgufChoice>,
) -> Result<&'a str> {
    let matching: Vec<&'a str> = match choice {
        None => ggufs.to_vec(),
        Some(GgufChoice::File(name)) => ggufs.iter().copied().filter(|f| f == name).collect(),
        Some(GgufChoice::Quant(q)) => {
            let q = q.to_ascii_lowercase();
            ggufs
                .iter()
                .copied()
                .filter(|f| f.to_ascii_lowercase().contains(&q))
                .collect()
        }
    };
    match (matching.as_slice(), choice) {
        ([one], _) => Ok(one),
        ([], Some(choice)) => Err(ModelError::Hub(format!(
            "no .gguf file of {repo} matches {choice}; choose one of: {}",
            ggufs.join(", ")
        ))),
        ([], None) => Err(ModelError::Hub(format!("{repo} has no .gguf file"))),
        (several, Some(choice)) => Err(ModelError::Hub(format!(
            "{} .gguf files of {repo} match {choice}: {}; give --gguf-file with one of them",
            several.len(),
            several.join(", ")
        ))),
        (several, None) => Err(ModelError::Hub(format!(
            "{repo} has {} .gguf files; pick one with --gguf-file NAME or {repo}:QUANT: {}",
            several.len(),
            several.join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_by_file_or_quantization() {
        let files = ["m-Q4_1.gguf", "m-Q8_0.gguf", "m-q4_1-imatrix.gguf"];
        let quant = |q: &str| GgufChoice::Quant(q.into());
        assert_eq!(
            pick_gguf("r", &files, Some(&quant("q8_0"))).unwrap(),
            "m-Q8_0.gguf"
        );
        let file = GgufChoice::File("m-Q4_1.gguf".into());
        assert_eq!(pick_gguf("r", &files, Some(&file)).unwrap(), "m-Q4_1.gguf");
        let err = pick_gguf("r", &files, Some(&quant("Q4_1")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("2 .gguf files") && err.contains("m-q4_1-imatrix.gguf"),
            "{err}"
        );
        let err = pick_gguf("r", &files, None).unwrap_err().to_string();
        assert!(
            err.contains("--gguf-file") && err.contains("m-Q8_0.gguf"),
            "{err}"
        );
        let err = pick_gguf("r", &files, Some(&quant("Q2_K")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("choose one of") && err.contains("m-Q4_1.gguf"),
            "{err}"
        );
        assert_eq!(pick_gguf("r", &files[..1], None).unwrap(), "m-Q4_1.gguf");
    }
}
