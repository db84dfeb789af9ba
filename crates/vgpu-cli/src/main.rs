//! `vgpu`: see `vgpu --help` and docs/cli.md.

#![deny(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = vgpu_cli::cli::Cli::parse();
    match vgpu_cli::dispatch(cli) {
        Ok(code) => code,
        Err(failure) => {
            eprintln!("vgpu: error: {failure}");
            ExitCode::from(failure.code)
        }
    }
}
