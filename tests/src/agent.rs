//! The real `vip-agent` binary run inside a lab namespace, killed on Drop.
use std::{
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::netns::NetNs;

/// The agent binary: $VIP_AGENT_BIN, else target/release/vip-agent next to the
/// test executable's deps/ directory (`cargo xtask test` builds it first).
pub fn agent_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("VIP_AGENT_BIN") {
        return Ok(p.into());
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        let p = dir.join("vip-agent");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("vip-agent binary not found near {}; build it with `cargo build --release -p vip-agent` (cargo xtask test does)", exe.display())
}

pub struct AgentProc {
    pub child: Child,
    pub log: PathBuf,
}

impl AgentProc {
    /// Starts `vip-agent run` in `ns` with `args` after `run`; output goes to `log`.
    pub fn start(ns: &NetNs, args: &[&str], log: &Path) -> Result<Self> {
        let out = std::fs::File::create(log)?;
        let child = ns
            .cmd(agent_bin()?.to_str().context("agent path")?)
            .arg("run")
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .spawn()
            .context("starting vip-agent")?;
        Ok(Self { child, log: log.to_owned() })
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `sig` to the agent.
    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Fails (with the agent's log) if the agent has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(st) = self.child.try_wait()? {
            bail!("vip-agent exited ({st}); log:\n{}", self.log_text());
        }
        Ok(())
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 20 ms until it returns Some or `limit` passes.
pub fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
