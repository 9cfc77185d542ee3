//! `vip-agent cleanup`: what vip leaves on a node once its agent is gone, removed.
//! The agent keeps its program attached and its maps pinned when it stops, so that
//! a restart or an upgrade forwards without a gap; uninstalling therefore takes
//! this explicit step on every node (deploy/cleanup/ runs it as a DaemonSet).
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

/// What [`cleanup`] removed.
#[derive(Debug, Default)]
pub struct Removed {
    /// Interfaces the program was detached from (their link pins removed).
    pub detached: Vec<String>,
    /// The pin directory, with the program and every map.
    pub pins: Option<PathBuf>,
    /// `announce: lo` addresses (label `lo:vip`) taken off `lo`.
    pub loopback: Vec<std::net::IpAddr>,
    /// The rules and blackhole routes of `route_guard` (rules, routes).
    pub route_guard: (usize, usize),
    pub status_file: Option<PathBuf>,
}

impl std::fmt::Display for Removed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.detached.as_slice() {
            [] => writeln!(f, "no XDP attachment of vip's found")?,
            d => writeln!(f, "detached from {}", d.join(", "))?,
        }
        match &self.pins {
            Some(p) => writeln!(f, "removed {} (the program and its maps)", p.display())?,
            None => writeln!(f, "no pin directory")?,
        }
        if !self.loopback.is_empty() {
            let a: Vec<String> = self.loopback.iter().map(ToString::to_string).collect();
            writeln!(f, "removed {} from lo (label {}, proto {:#x})", a.join(", "), crate::ha::loopback::LABEL, crate::ha::loopback::PROTO)?;
        }
        if self.route_guard != (0, 0) {
            let (rules, routes) = self.route_guard;
            writeln!(
                f,
                "removed {rules} routing rule(s) to table {} and {routes} blackhole route(s) from it (proto {:#x})",
                crate::route_guard::TABLE,
                crate::route_guard::PROTO
            )?;
        }
        if let Some(s) = &self.status_file {
            writeln!(f, "removed {}", s.display())?;
        }
        Ok(())
    }
}

/// Detaches the program from every interface (each link detached, its pin
/// removed), removes the pin directory (program and maps: the kernel frees them
/// with their last reference), vip's addresses on `lo`, its routing rules and
/// blackhole routes (route_guard) and the status file.
pub async fn cleanup(pin_dir: &Path, status_file: &Path) -> Result<Removed> {
    let mut out = Removed::default();
    for iface in crate::dataplane::pinned_links(pin_dir)? {
        if crate::dataplane::detach(pin_dir, &iface)? {
            out.detached.push(iface);
        }
    }
    if pin_dir.exists() {
        std::fs::remove_dir_all(pin_dir).with_context(|| format!("removing {}", pin_dir.display()))?;
        out.pins = Some(pin_dir.to_owned());
    }
    let handle = crate::route_guard::handle()?;
    if let Ok((lo, _)) = crate::dataplane::iface_info("lo") {
        out.loopback = crate::ha::loopback::remove_ours(&handle, lo).await.context("removing vip's addresses from lo")?;
    }
    out.route_guard = crate::route_guard::remove_ours(&handle).await.context("removing vip's routing rules and blackhole routes")?;
    if status_file.exists() {
        std::fs::remove_file(status_file).with_context(|| format!("removing {}", status_file.display()))?;
        out.status_file = Some(status_file.to_owned());
    }
    Ok(out)
}
