//! `vgpu run`: choose the job's usage table, set the HAMi environment, preload libvgpu.so,
//! and exec the program.

use std::ffi::{OsStr, OsString};
use std::io::IsTerminal;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use vgpu_env::{self as config, Config};

use crate::Failure;
use crate::cli::{RunArgs, RunDriver};
use crate::hook_env::{HookEnv, HookSetup, hook_env, library_path_with, make_sim_link_dir};
use crate::limits::is_limit_var;
use crate::{job_cleanup, locate, turn_dir, usage_file};

fn shell_quote(s: &OsStr) -> String {
    let s = s.to_string_lossy();
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-=:,+".contains(&b))
    {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The usage table a job gets (see [`crate::usage_file`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Table {
    /// A fresh table of its own, removed when the job ends.
    Private,
    /// `--share NAME`.
    Shared(PathBuf),
    /// `--cache PATH`.
    Explicit(PathBuf),
    /// `CUDA_DEVICE_MEMORY_SHARED_CACHE` set by whoever started vgpu (a HAMi container).
    Inherited(PathBuf),
}

fn choose_table(args: &RunArgs) -> Table {
    if let Some(p) = &args.cache {
        return Table::Explicit(p.clone());
    }
    if let Some(name) = &args.share {
        return Table::Shared(usage_file::share_path(name));
    }
    match std::env::var_os(config::ENV_SHARED_CACHE) {
        Some(v) if !v.is_empty() => Table::Inherited(PathBuf::from(v)),
        _ => Table::Private,
    }
}

/// Whether the job sets limits of a kind (flags, or inherited variables passed through).
fn sets_kind(env: &HookEnv, asked: bool, base: &str) -> bool {
    asked
        || std::env::vars_os().any(|(k, _)| {
            k.to_str()
                .is_some_and(|k| is_limit_var(base, k) && env.lookup(k).is_some())
        })
}

fn note(text: &str) {
    eprintln!("vgpu: note: {text}");
}

fn print_dry_run(args: &RunArgs, table: &Table, env: &HookEnv) {
    if *table == Table::Private {
        println!(
            "# {}: a private usage table, created for the job and removed when it ends",
            config::ENV_SHARED_CACHE
        );
    }
    if args.driver == RunDriver::Simulated {
        println!("# LD_LIBRARY_PATH: the simulated driver's directory, created for the job");
    }
    for name in &env.remove {
        println!("unset {name}");
    }
    for (k, v) in &env.set {
        println!("{k}={}", shell_quote(OsStr::new(v)));
    }
    let words: Vec<String> = args.command.iter().map(|a| shell_quote(a)).collect();
    println!("exec {}", words.join(" "));
}

/// Create the job's table (private) or check the one it joins, and point the environment
/// at it; `job_dir` is the job's private directory, if it has one.
fn set_up_table(
    args: &RunArgs,
    table: &Table,
    job_dir: Option<&Path>,
    env: &mut HookEnv,
) -> Result<(), Failure> {
    match (table, job_dir) {
        (Table::Private, Some(dir)) => {
            let path = dir.join(usage_file::PRIVATE_FILE_NAME);
            usage_file::create_table_file(&path, 0o600)
                .map_err(|e| Failure::msg(format!("cannot create {}: {e}", path.display())))?;
            let s = path.to_str().ok_or_else(|| {
                Failure::msg(format!(
                    "{} is not valid UTF-8 (set TMPDIR)",
                    path.display()
                ))
            })?;
            env.set
                .insert(config::ENV_SHARED_CACHE.to_owned(), s.to_owned());
            if std::io::stderr().is_terminal() {
                note(&format!(
                    "this job's own usage table: {s} (removed when the job ends; --share NAME joins a group)"
                ));
            }
            return Ok(());
        }
        (Table::Private, None) => {
            return Err(Failure::msg("no private directory for the job's table"));
        }
        (Table::Shared(p) | Table::Explicit(p), _) => {
            usage_file::prepare_explicit(p, args.all_users)?;
        }
        (Table::Inherited(_), _) => {}
    }
    // A table others may use: its stored limits and host policy must not silently override
    // this job's.
    let cfg = Config::from_vars(&env.vars())
        .map_err(|e| Failure::msg(format!("the program's environment would be invalid: {e}")))?;
    let asked = usage_file::Asked {
        memory: sets_kind(env, !args.memory.is_empty(), config::ENV_MEMORY_LIMIT),
        sm: sets_kind(env, !args.sm.is_empty(), config::ENV_SM_LIMIT),
        host_policy: [config::ENV_HOST_SPILL, config::ENV_OVERSUBSCRIBE]
            .iter()
            .any(|v| env.lookup(v).is_some()),
    };
    let may_replace = !matches!(table, Table::Inherited(_));
    for n in usage_file::reconcile_limits(Path::new(&cfg.shared_cache), &cfg, asked, may_replace)? {
        note(&n);
    }
    Ok(())
}

/// Run `vgpu run`: on success this never returns (the process becomes the program).
pub fn run(args: &RunArgs) -> Result<std::process::ExitCode, Failure> {
    let hook = locate::find_hook(args.lib.as_deref())?;
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::usage("no command given"))?;
    let table = choose_table(args);
    if matches!(table, Table::Shared(_)) {
        // Also for --dry-run: the environment is checked as the hook will see it.
        usage_file::ensure_user_dir()?;
    }
    let cache = match &table {
        Table::Shared(p) | Table::Explicit(p) => Some(p.as_path()),
        Table::Private | Table::Inherited(_) => None,
    };
    let mut env = hook_env(&HookSetup {
        hook: &hook.path,
        memory: &args.memory,
        sm: &args.sm,
        cache,
    })?;
    if args.dry_run {
        print_dry_run(args, &table, &env);
        return Ok(std::process::ExitCode::SUCCESS);
    }

    let job_dir = if table == Table::Private || args.driver == RunDriver::Simulated {
        Some(usage_file::create_job_dir()?)
    } else {
        None
    };
    // From here on the directory is removed when the job ends, also if this fails.
    if let Some(dir) = &job_dir {
        if let Err(e) = job_cleanup::arrange(std::process::id(), dir) {
            note(&format!("{e}; remove {} after the job", dir.display()));
        }
    }
    set_up_table(args, &table, job_dir.as_deref(), &mut env)?;
    let cfg = Config::from_vars(&env.vars())
        .map_err(|e| Failure::msg(format!("the program's environment would be invalid: {e}")))?;
    if cfg.sm_limit.iter().any(Option::is_some) {
        if let Some(dir) = &cfg.sm_tuning.turn_dir {
            if let Err(w) = turn_dir::ensure(Path::new(dir)) {
                eprintln!("vgpu: warning: {w}");
            }
        }
    }
    if let (RunDriver::Simulated, Some(dir)) = (args.driver, &job_dir) {
        let sim = locate::find_sim()?;
        let links = dir.join("driver");
        make_sim_link_dir(&sim.path, &links)?;
        env.set
            .insert("LD_LIBRARY_PATH".into(), library_path_with(&links));
    }
    let mut cmd = Command::new(program);
    cmd.args(rest);
    env.apply(&mut cmd);
    let err = cmd.exec();
    Err(exec_failure(program, &err))
}

/// The failure of starting `program`, with the shell's exit codes (127 not found, 126 not runnable).
pub fn exec_failure(program: &OsString, err: &std::io::Error) -> Failure {
    let code = if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    };
    Failure {
        code,
        message: format!("cannot run `{}`: {err}", program.to_string_lossy()),
    }
}
