//! Where this node answers its VIPs: each pool's interface on this host
//! (`links::resolve`), the program attached to every interface that needs it (a
//! VLAN sub-interface's parent for a VLAN), and their MACs and VLANs recorded in
//! the maps. Re-run when the model changes and with every host check, so that an
//! interface created after the agent started is taken up.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use tracing::{info, warn};

use super::liveness::Uplinks;
use crate::{
    dataplane::{self, AttachMode, Dataplane},
    links::{self, Link},
    model::World,
    spec::Mac,
};

pub struct Interfaces {
    /// `--iface`: the interface of pools that name none, and this node's home.
    default_iface: Option<String>,
    mode: AttachMode,
    /// Interfaces the program runs on (name → ifindex), attached by this agent
    /// or kept from an earlier one.
    attached: BTreeMap<String, u32>,
    /// Interfaces whose attachment failed, with why (retried at every placement).
    failed: BTreeMap<String, String>,
    /// Interfaces that strip VLAN tags before XDP and cannot be told not to.
    stripping: BTreeSet<String>,
}

/// What a placement found: where VIPs go, and what is wrong (host problems).
pub struct Placement {
    pub uplinks: Arc<Uplinks>,
    pub problems: Vec<String>,
}

impl Interfaces {
    pub fn new(default_iface: Option<String>, mode: AttachMode) -> Self {
        Self { default_iface, mode, attached: BTreeMap::new(), failed: BTreeMap::new(), stripping: BTreeSet::new() }
    }

    /// Whether every interface the program runs on is attached in native mode (as
    /// recorded in `lb_ifaces`): then the XDP frame sender can reach them all.
    pub fn all_native(&self, dp: &Dataplane) -> bool {
        !self.attached.is_empty() && self.attached.values().all(|i| dp.iface_native(*i))
    }

    /// An interface the program runs on (0 when none).
    pub fn first_ifindex(&self) -> u32 {
        self.attached.values().next().copied().unwrap_or(0)
    }

    /// How many interfaces the program runs on.
    pub fn attached_count(&self) -> usize {
        self.attached.len()
    }

    /// Resolves where `me`'s pools live on this host, attaches the program where
    /// needed and records interfaces and VLANs in the maps.
    pub fn place(&mut self, dp: &mut Dataplane, world: &World, me: &str) -> Placement {
        let mut problems = Vec::new();
        let host = match links::read_host() {
            Ok(h) => h,
            Err(e) => {
                problems.push(format!("cannot read this host's interfaces: {e:#}"));
                return Placement { uplinks: Arc::new(Uplinks::default()), problems };
            }
        };
        let resolved = links::resolve(world, me, self.default_iface.as_deref(), &host);
        problems.extend(resolved.problems);
        let home = world.node(me).map(|n| links::home(n.addr, self.default_iface.as_deref(), &host));
        let home = match home {
            Some(Ok(l)) => Some(l),
            Some(Err(why)) => {
                problems.push(why.to_string());
                None
            }
            None => None,
        };
        let mut by_pool = resolved.by_pool;
        let parents: BTreeSet<(String, u32)> = by_pool.values().chain(&home).map(|l| (l.xdp_iface.clone(), l.xdp_ifindex)).collect();
        for (name, ifindex) in parents {
            if let Err(why) = self.attach(dp, &name, ifindex) {
                problems.push(why);
            }
        }
        // Pools on an interface the program does not run on cannot be answered.
        by_pool.retain(|pool, l| {
            let ok = self.attached.get(&l.xdp_iface) == Some(&l.xdp_ifindex);
            if !ok {
                problems.push(format!("pool {pool:?}: the program is not attached to {} (see above), so its VIPs are not answered here", l.xdp_iface));
            }
            ok
        });
        for name in &self.stripping {
            problems.push(format!(
                "{name} strips 802.1Q tags before XDP and its driver refuses to stop (rx-vlan-hw-parse fixed on): \
                 frames of every VLAN look untagged to the program, so VIPs of {name}'s untagged network are answered on its VLANs too"
            ));
        }
        if let Err(e) = self.record_vlans(dp, by_pool.values()) {
            problems.push(format!("recording VLANs in lb_vlans: {e:#}"));
        }
        // Backends' MACs are those of the network nodes are reached on: frames to
        // VIPs of other networks go to them out of home, untagged.
        let home_untagged = home.as_ref().filter(|h| h.vlan.is_none() && self.attached.get(&h.name) == Some(&h.ifindex));
        let elsewhere: Vec<&String> = by_pool.iter().filter(|(_, l)| home.as_ref().is_none_or(|h| h.ifindex != l.ifindex)).map(|(p, _)| p).collect();
        if home_untagged.is_none() && !elsewhere.is_empty() {
            problems.push(format!(
                "pools {elsewhere:?} live on another network than this node's address, and this node's home interface is {}: \
                 their frames are forwarded on their own network, where backends must then have the same MAC",
                home.as_ref().map_or("not found".to_owned(), |h| format!("{} (a VLAN, or without the program)", h.name))
            ));
        }
        if let Err(e) = dp.set_home(home_untagged.map(|h| (h.ifindex, h.mac))) {
            problems.push(format!("recording the home interface in lb_home: {e:#}"));
        }
        Placement { uplinks: Arc::new(Uplinks { by_pool, home }), problems }
    }

    /// Attaches the program to `name` unless it runs there already; VLAN tags are
    /// kept in frames first (see `dataplane::keep_vlan_tags`).
    fn attach(&mut self, dp: &mut Dataplane, name: &str, ifindex: u32) -> Result<(), String> {
        if self.attached.get(name) == Some(&ifindex) {
            return Ok(());
        }
        match dataplane::keep_vlan_tags(name) {
            Ok(true) => {
                self.stripping.remove(name);
            }
            Ok(false) => {
                self.stripping.insert(name.to_owned());
            }
            Err(e) => warn!(iface = name, "cannot check receive VLAN stripping: {e:#}"),
        }
        match dp.attach(name, self.mode) {
            Ok(a) => {
                info!(iface = name, ifindex = a.ifindex, mac = %Mac(a.mac), mode = ?a.mode, "XDP attached (None: kept the existing attachment)");
                self.attached.insert(name.to_owned(), a.ifindex);
                self.failed.remove(name);
                Ok(())
            }
            Err(e) => {
                let why = format!("cannot attach the XDP program to {name}: {e:#}");
                if self.failed.insert(name.to_owned(), why.clone()).as_ref() != Some(&why) {
                    warn!("{why}");
                }
                Err(why)
            }
        }
    }

    /// VLAN sub-interfaces get their MAC in `lb_ifaces` and their (parent, VLAN id)
    /// in `lb_vlans`; VLANs no pool lives on any more are removed.
    fn record_vlans<'a>(&self, dp: &mut Dataplane, links: impl Iterator<Item = &'a Link>) -> anyhow::Result<()> {
        let mut want = BTreeMap::new();
        for l in links {
            if let Some(vid) = l.vlan {
                dp.set_iface(l.ifindex, l.mac)?;
                want.insert((l.xdp_ifindex, vid), l.ifindex);
            }
        }
        let have = dp.held_ref().vlans()?;
        for ((parent, vid), ifindex) in &want {
            if have.get(&(*parent, *vid)) != Some(ifindex) {
                dp.set_vlan(*parent, *vid, *ifindex)?;
                info!(parent, vid, ifindex, "serving VLAN");
            }
        }
        for (parent, vid) in have.keys().filter(|k| !want.contains_key(k)) {
            dp.remove_vlan(*parent, *vid)?;
            info!(parent, vid, "no pool lives on VLAN any more");
        }
        Ok(())
    }
}
