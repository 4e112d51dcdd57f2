//! `kinference crdgen`: the `kinference.io` CRDs as YAML, generated from `kinference-k8s`'s
//! types; with `--dir` one file per CRD as the `kinference-crds` chart holds them.

use std::path::PathBuf;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct CrdgenArgs {
    /// Write `kinference.io_<plural>.yaml` files into this directory instead of printing
    /// (e.g. charts/kinference-crds/crds).
    #[arg(long)]
    dir: Option<PathBuf>,
}

pub fn run(args: CrdgenArgs) -> anyhow::Result<()> {
    let files = kinference_k8s::crd_files().context("serialising the CRDs")?;
    match args.dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for (name, yaml) in files {
                let path = dir.join(name);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        None => {
            let docs: Vec<String> = files.into_iter().map(|(_, yaml)| yaml).collect();
            print!("{}", docs.join("---\n"));
        }
    }
    Ok(())
}
