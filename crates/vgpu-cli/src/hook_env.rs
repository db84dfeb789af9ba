//! The environment a program gets under the hook (`vgpu run`, and the demo's and doctor's
//! probes): the limit variables, the usage file and `LD_PRELOAD`, checked with vgpu-env's
//! parser as the hook will read them; and, for the simulated driver, the directory of links
//! that serves it as `libcuda.so.1` / `libnvidia-ml.so.1` on `LD_LIBRARY_PATH`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use vgpu_env::{self as config, Config, Vars};

use crate::Failure;
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
        // A device given twice is bad usage, like a value that does not parse.
        set: limits::limit_env(setup.memory, setup.sm).map_err(Failure::usage)?,
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

/// Names the simulated driver is served under.
pub const SIM_LINK_NAMES: &[&str] = &[
    "libcuda.so.1",
    "libcuda.so",
    "libnvidia-ml.so.1",
    "libnvidia-ml.so",
];

/// A directory of symlinks that makes `libvgpusim.so` the driver for whoever puts the
/// directory first on `LD_LIBRARY_PATH`.
pub fn make_sim_link_dir(sim: &Path, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for name in SIM_LINK_NAMES {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(sim, &link)
            .map_err(|e| format!("cannot link {} -> {}: {e}", link.display(), sim.display()))?;
    }
    Ok(())
}

/// `LD_LIBRARY_PATH` with `dir` first, keeping what was there.
pub fn library_path_with(dir: &Path) -> String {
    match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", dir.display()),
        _ => dir.display().to_string(),
    }
}
