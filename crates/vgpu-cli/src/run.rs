//! `vgpu run`: set the HAMi environment, preload libvgpu.so, and exec the program.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use vgpu_env::{self as config, Config, Vars};

use crate::Failure;
use crate::cli::RunArgs;
use crate::limits::{self, is_limit_var};
use crate::locate;

/// The environment a program gets under the hook: variables to set and variables to remove.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookEnv {
    /// Variables to set, in a stable order.
    pub set: BTreeMap<String, String>,
    /// Inherited variables to remove (replaced by flags of the same kind).
    pub remove: Vec<String>,
}

impl HookEnv {
    /// Apply to a command about to be spawned or exec'd.
    pub fn apply(&self, cmd: &mut Command) {
        for name in &self.remove {
            cmd.env_remove(name);
        }
        cmd.envs(&self.set);
    }

    /// Look a variable up as the program will see it, given the inherited environment.
    pub fn lookup(&self, name: &str) -> Option<String> {
        if let Some(v) = self.set.get(name) {
            return Some(v.clone());
        }
        if self.remove.iter().any(|r| r == name) {
            return None;
        }
        std::env::var(name).ok()
    }

    /// Every variable as the program will see them, given the inherited environment.
    pub fn vars(&self) -> Vars {
        let mut vars = Vars::from_os(std::env::vars_os());
        for name in &self.remove {
            vars.remove(name);
        }
        for (name, value) in &self.set {
            vars.set(name.as_str(), value.as_str());
        }
        vars
    }
}

/// Everything `run` (and the demo and doctor probes) need to start a program under the hook.
#[derive(Debug, Clone)]
pub struct HookSetup<'a> {
    /// Path of libvgpu.so.
    pub hook: &'a Path,
    /// `--memory` flags.
    pub memory: &'a [limits::MemoryFlag],
    /// `--sm` flags.
    pub sm: &'a [limits::SmFlag],
    /// `--cache`.
    pub cache: Option<&'a Path>,
}

/// Compute the environment for `setup`, checked with vgpu-env's parser as the hook will read it.
pub fn hook_env(setup: &HookSetup<'_>) -> Result<HookEnv, Failure> {
    let mut env = HookEnv {
        set: limits::limit_env(setup.memory, setup.sm)?,
        remove: Vec::new(),
    };
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let replaced = (!setup.memory.is_empty() && is_limit_var(config::ENV_MEMORY_LIMIT, name))
            || (!setup.sm.is_empty() && is_limit_var(config::ENV_SM_LIMIT, name));
        if replaced && !env.set.contains_key(name) {
            env.remove.push(name.to_owned());
        }
    }
    env.remove.sort();
    if let Some(cache) = setup.cache {
        // Absolute, so the program finds the same file whatever its working directory.
        let abs = std::path::absolute(cache)
            .map_err(|e| Failure::msg(format!("--cache {}: {e}", cache.display())))?;
        let s = abs
            .to_str()
            .ok_or_else(|| Failure::msg(format!("--cache {} is not valid UTF-8", abs.display())))?;
        if abs.is_dir() {
            return Err(Failure::msg(format!(
                "--cache {s} is a directory; give the path of a file"
            )));
        }
        if let Some(parent) = abs.parent().filter(|p| !p.is_dir()) {
            return Err(Failure::msg(format!(
                "--cache {s}: the directory {} does not exist (the hook creates the file, not the directory)",
                parent.display()
            )));
        }
        env.set
            .insert(config::ENV_SHARED_CACHE.to_owned(), s.to_owned());
    }
    let lib = locate::check_preloadable(setup.hook)?;
    let existing = std::env::var("LD_PRELOAD").ok();
    env.set.insert(
        "LD_PRELOAD".to_owned(),
        locate::prepend_preload(lib, existing.as_deref()),
    );
    // The whole environment as the hook will parse it: inherited bad values fail here, with
    // the variable named, instead of inside the program.
    Config::from_vars(&env.vars())
        .map_err(|e| Failure::msg(format!("the program's environment would be invalid: {e}")))?;
    Ok(env)
}

/// The limits already stored in an existing usage file win over the environment (as in
/// HAMi-core); say so when they differ from what the flags ask for.
fn warn_if_file_wins(env: &HookEnv) {
    let Some(path) = env
        .lookup(config::ENV_SHARED_CACHE)
        .or_else(|| Some(config::DEFAULT_SHARED_CACHE.to_owned()))
    else {
        return;
    };
    let Ok(Some(report)) = crate::report::read_if_exists(Path::new(&path)) else {
        return;
    };
    let Ok(cfg) = Config::from_vars(&env.vars()) else {
        return;
    };
    for dev in &report.devices {
        let want = cfg.memory_limit.get(dev.index as usize).copied().flatten();
        if want != dev.memory_limit_bytes {
            eprintln!(
                "vgpu: note: {path} already holds a memory limit of {} for device {}; the file wins over \
                 --memory/environment ({}). Change it with `vgpu set-limit` or remove the file when no process uses it.",
                crate::units::format_limit(dev.memory_limit_bytes),
                dev.index,
                crate::units::format_limit(want),
            );
        }
    }
}

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

/// Run `vgpu run`: on success this never returns (the process becomes the program).
pub fn run(args: &RunArgs) -> Result<std::process::ExitCode, Failure> {
    let hook = locate::find_hook(args.lib.as_deref())?;
    let env = hook_env(&HookSetup {
        hook: &hook.path,
        memory: &args.memory,
        sm: &args.sm,
        cache: args.cache.as_deref(),
    })?;
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::usage("no command given"))?;
    if args.dry_run {
        for name in &env.remove {
            println!("unset {name}");
        }
        for (k, v) in &env.set {
            println!("{k}={}", shell_quote(OsStr::new(v)));
        }
        let words: Vec<String> = args.command.iter().map(|a| shell_quote(a)).collect();
        println!("exec {}", words.join(" "));
        return Ok(std::process::ExitCode::SUCCESS);
    }
    if !args.memory.is_empty() {
        warn_if_file_wins(&env);
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
