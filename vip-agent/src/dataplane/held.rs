//! The neighbour side of the data path: interfaces (`lb_ifaces`), VLANs
//! (`lb_vlans`) and held VIPs (`arp_held` for IPv4, `ndp_held` for IPv6). A handle of its own, so that the liveness thread refreshes
//! deadlines through file descriptors no ring write ever waits behind.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

use anyhow::{bail, Context as _, Result};
use aya::maps::{Array, HashMap, IterableMap as _, MapData, PerCpuArray};
use vip_common::{
    held_slot, map_names as names, vip_filter_bit, vip_filter_bit6, ArpHeldKey, ArpWatch, Counter, HeldVip, Lb4HeldSlot, Lb6HeldSlot, LbHome, LbIface,
    LbVlanKey, NdpHeldKey, Reason, ARP_WATCH_MACS, HELD_NO_ARP, IFACE_NATIVE, VIP_FILTER_WORDS,
};

use super::{batch, coarse_slack_ns, counters::sum, filter_bits, flow_cache, ignore_missing, open_pinned};

/// How a held VIP is announced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum HeldMode {
    /// Answer ARP (IPv6: neighbour solicitations) for it, and announce it on
    /// takeover (gratuitous ARP, unsolicited neighbour advertisements).
    #[default]
    Arp,
    /// Balance it but answer no ARP: a routing daemon announces it from `lo`.
    Lo,
}

impl HeldMode {
    fn flags(self) -> u8 {
        match self {
            HeldMode::Arp => 0,
            HeldMode::Lo => HELD_NO_ARP,
        }
    }

    fn from_flags(f: u8) -> Self {
        if f & HELD_NO_ARP != 0 {
            HeldMode::Lo
        } else {
            HeldMode::Arp
        }
    }
}

/// A held-VIP entry as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldEntry {
    pub ifindex: u32,
    pub vip: IpAddr,
    /// The deadline the data path applies ([`coarse_slack_ns`] before the one asked for).
    pub deadline_ns: u64,
    pub announce: HeldMode,
}

pub struct HeldVips {
    ifaces: HashMap<MapData, u32, LbIface>,
    /// (parent ifindex, VLAN id) → the VLAN sub-interface's ifindex.
    vlans: HashMap<MapData, LbVlanKey, u32>,
    /// 0 → the home interface (frames to VIPs of other networks leave there).
    home: Array<MapData, LbHome>,
    held: HashMap<MapData, ArpHeldKey, HeldVip>,
    held6: HashMap<MapData, NdpHeldKey, HeldVip>,
    /// `lb_held_filter`: the bits of the VIPs with an entry in either (a superset),
    /// and what this handle last wrote there. The data path takes it as a hint
    /// only (a flow's packet loads its flow-table line before the held-VIP
    /// lookup), so a bit lost to another handle's write costs speed, never a
    /// verdict; the agent writes held VIPs through the liveness thread's handle.
    /// None when pinned by an older agent that had no such map.
    held_filter: Option<Array<MapData, [u32; VIP_FILTER_WORDS as usize]>>,
    held_bits: [u32; VIP_FILTER_WORDS as usize],
    /// `lb4_held_slots` and `lb6_held_slots`; None when pinned by an older agent.
    slots: Option<HeldSlots>,
    /// (ifindex, VIP) → conflicting claims the data path saw.
    conflicts: HashMap<MapData, ArpHeldKey, u64>,
    conflicts6: HashMap<MapData, NdpHeldKey, u64>,
    /// (ifindex, VIP of another node) → ARP answers seen for it (the ARP
    /// self-check); None when pinned by an older agent that had no such map.
    watch: Option<HashMap<MapData, ArpHeldKey, ArpWatch>>,
    stats: PerCpuArray<MapData, Counter>,
    epoch: flow_cache::Ctl,
    /// (ifindex, VIP) → the MAC (as node_mac_key) of the node that held the VIP
    /// before this one took it: asked about flows this node never saw
    /// (`arp_handoff`, `ndp_handoff`). None when pinned by an older agent.
    handoff: Option<(Handoffs<ArpHeldKey>, Handoffs<NdpHeldKey>)>,
}

/// A family's previous-holder map: held key → node_mac_key.
type Handoffs<K> = HashMap<MapData, K, u64>;

impl HeldVips {
    /// The maps pinned under `dir`, with the epoch lock shared with the ring side.
    pub(super) fn open(dir: &Path, epoch: flow_cache::Ctl) -> Result<Self> {
        let held_filter: Option<Array<MapData, [u32; VIP_FILTER_WORDS as usize]>> = open_pinned(dir, names::HELD_FILTER).ok();
        let held_bits = match &held_filter {
            Some(f) => f.get(&0, 0).context("reading lb_held_filter")?,
            None => [0; VIP_FILTER_WORDS as usize],
        };
        Ok(Self {
            held_filter,
            held_bits,
            slots: HeldSlots::open(dir),
            ifaces: open_pinned(dir, names::IFACES)?,
            vlans: open_pinned(dir, names::VLANS)?,
            home: open_pinned(dir, names::HOME)?,
            held: open_pinned(dir, names::HELD)?,
            held6: open_pinned(dir, names::HELD6)?,
            conflicts: open_pinned(dir, names::CONFLICTS)?,
            conflicts6: open_pinned(dir, names::CONFLICTS6)?,
            watch: open_pinned(dir, names::ARP_WATCH).ok(),
            stats: open_pinned(dir, names::STATS)?,
            epoch,
            handoff: open_pinned(dir, names::HANDOFF).ok().zip(open_pinned(dir, names::HANDOFF6).ok()),
        })
    }

    /// A second handle on the same pinned maps (own descriptors, shared epoch lock).
    pub(super) fn reopen(&self, dir: &Path) -> Result<Self> {
        Self::open(dir, self.epoch.clone())
    }

    /// Records the MAC of an interface the program runs on, with its flags set to
    /// `flags` or kept as recorded when `None`. VIPs held on it get the new MAC too.
    pub(super) fn write_iface(&mut self, ifindex: u32, mac: [u8; 6], flags: Option<u8>) -> Result<()> {
        let flags = flags.unwrap_or_else(|| self.ifaces.get(&ifindex, 0).map_or(0, |c| c.flags));
        self.ifaces.insert(ifindex, LbIface { mac, flags, _pad: 0 }, 0)?;
        let stale: Vec<(ArpHeldKey, HeldVip)> = self.held.iter().filter_map(|kv| kv.ok()).filter(|(k, h)| k.ifindex == ifindex && h.mac != mac).collect();
        let stale6: Vec<(NdpHeldKey, HeldVip)> = self.held6.iter().filter_map(|kv| kv.ok()).filter(|(k, h)| k.ifindex == ifindex && h.mac != mac).collect();
        let changed = !stale.is_empty() || !stale6.is_empty();
        // Their slots carry the old MAC: emptied first, filled again by the next refresh.
        for k in stale.iter().map(|(k, _)| Key::V4(*k)).chain(stale6.iter().map(|(k, _)| Key::V6(*k))) {
            self.clear_slot(&k)?;
        }
        for (k, h) in stale {
            self.held.insert(k, HeldVip { mac, ..h }, 0)?;
        }
        for (k, h) in stale6 {
            self.held6.insert(k, HeldVip { mac, ..h }, 0)?;
        }
        if changed {
            self.epoch.bump()?; // cached answers carry the old MAC
        }
        Ok(())
    }

    /// Serves VLAN `vid` arriving tagged on `parent` as the network of the
    /// sub-interface `ifindex`: its VIPs are held under `ifindex` (whose MAC must
    /// be recorded with `write_iface`). Tagged frames of VLANs not recorded here
    /// pass untouched (`passed_vlan_other`).
    pub fn set_vlan(&mut self, parent: u32, vid: u16, ifindex: u32) -> Result<()> {
        self.vlans.insert(LbVlanKey { ifindex: parent, vid: u32::from(vid) }, ifindex, 0).context("writing lb_vlans")
    }

    /// Stops serving VLAN `vid` on `parent`.
    pub fn remove_vlan(&mut self, parent: u32, vid: u16) -> Result<()> {
        ignore_missing(self.vlans.remove(&LbVlanKey { ifindex: parent, vid: u32::from(vid) })).context("removing from lb_vlans")
    }

    /// The VLANs served: (parent ifindex, VLAN id) → sub-interface ifindex.
    pub fn vlans(&self) -> Result<BTreeMap<(u32, u16), u32>> {
        self.vlans.iter().map(|kv| kv.map(|(k, v)| ((k.ifindex, k.vid as u16), v)).map_err(Into::into)).collect()
    }

    /// Sets the home interface (its ifindex, our MAC there; None: unset, every
    /// frame is forwarded on the network it came from). Frames to VIPs living on
    /// another network are forwarded to backends out of it, untagged.
    pub fn set_home(&mut self, home: Option<(u32, [u8; 6])>) -> Result<()> {
        let want = home.map_or_else(LbHome::default, |(ifindex, mac)| LbHome { ifindex, mac, _pad: [0; 2] });
        if self.home.get(&0, 0).ok() != Some(want) {
            self.home.set(0, want, 0).context("writing lb_home")?;
            self.epoch.bump()?; // cached answers were for the old home
        }
        Ok(())
    }

    /// The home interface as set (ifindex 0: none).
    pub fn home(&self) -> Result<LbHome> {
        Ok(self.home.get(&0, 0)?)
    }

    /// Whether the program runs on `ifindex` in native mode, as recorded when this
    /// or an earlier agent attached it (the driver can then transmit XDP frames).
    pub fn iface_native(&self, ifindex: u32) -> bool {
        self.ifaces.get(&ifindex, 0).is_ok_and(|c| c.flags & IFACE_NATIVE != 0)
    }

    /// Holds `vip` on `ifindex` until `deadline_ns` (CLOCK_MONOTONIC). Call again
    /// before it passes to keep holding; past it the data path stops answering
    /// (the entry stores `deadline_ns - coarse_slack_ns()`, see [`coarse_slack_ns`]).
    /// The entry carries the interface's MAC, so the interface must be recorded
    /// first. No flow-cache epoch bump (this runs on every refresh): cached answers
    /// are only for pinned flows, which are forwarded whatever the deadline, and the
    /// MAC only changes through `write_iface`.
    pub fn hold(&mut self, ifindex: u32, vip: IpAddr, deadline_ns: u64, announce: HeldMode) -> Result<()> {
        self.hold_all(ifindex, &[(vip, announce)], deadline_ns)
    }

    /// [`Self::hold`] for many VIPs in one system call per family (the refresh
    /// of every held VIP).
    pub fn hold_all(&mut self, ifindex: u32, vips: &[(IpAddr, HeldMode)], deadline_ns: u64) -> Result<()> {
        let mac = match self.ifaces.get(&ifindex, 0) {
            Ok(cfg) => cfg.mac,
            Err(aya::maps::MapError::KeyNotFound) => {
                bail!("cannot hold VIPs on interface {ifindex}: no MAC recorded for it (attach to the interface, or call set_iface, first)")
            }
            Err(e) => return Err(e).context("reading lb_ifaces"),
        };
        let deadline_ns = deadline_ns.saturating_sub(coarse_slack_ns());
        let value = |a: &HeldMode| HeldVip { deadline_ns, mac, flags: a.flags(), _pad: 0 };
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for (vip, a) in vips {
            match key(ifindex, *vip) {
                Key::V4(k) => v4.push((k, value(a))),
                Key::V6(k) => v6.push((k, value(a))),
            }
        }
        self.mark_held(vips.iter().map(|(vip, _)| *vip))?;
        if !v4.is_empty() {
            batch::update(self.held.map(), &v4).context("writing arp_held")?;
        }
        if !v6.is_empty() {
            batch::update(self.held6.map(), &v6).context("writing ndp_held")?;
        }
        // Their slots after them: a slot is never ahead of its entry.
        match self.slots.as_mut() {
            Some(slots) => slots.write(&v4, &v6),
            None => Ok(()),
        }
    }

    /// Records `prev` as the node that held `vip` (on `ifindex`) before this
    /// one: a TCP segment of a flow this node never saw is asked about there
    /// (see `vip_common::ETH_P_ASK4`). Written before the VIP is held, so that no
    /// such segment is hashed on our ring meanwhile. A no-op on an older agent's pins.
    pub fn hand_off(&mut self, ifindex: u32, vip: IpAddr, prev: [u8; 6]) -> Result<()> {
        let Some((v4, v6)) = self.handoff.as_mut() else { return Ok(()) };
        let value = vip_common::node_mac_key(prev);
        match key(ifindex, vip) {
            Key::V4(k) => v4.insert(k, value, 0).context("writing arp_handoff"),
            Key::V6(k) => v6.insert(k, value, 0).context("writing ndp_handoff"),
        }
    }

    /// Forgets `vip`'s previous holder (released, or taken from none we know).
    pub fn end_handoff(&mut self, ifindex: u32, vip: IpAddr) -> Result<()> {
        let Some((v4, v6)) = self.handoff.as_mut() else { return Ok(()) };
        match key(ifindex, vip) {
            Key::V4(k) => ignore_missing(v4.remove(&k)).context("removing from arp_handoff"),
            Key::V6(k) => ignore_missing(v6.remove(&k)).context("removing from ndp_handoff"),
        }
    }

    /// Every (ifindex, VIP) → its previous holder's MAC, as recorded.
    pub fn handoffs(&self) -> Result<BTreeMap<(u32, IpAddr), [u8; 6]>> {
        let Some((v4, v6)) = self.handoff.as_ref() else { return Ok(BTreeMap::new()) };
        let mac = |w: u64| -> [u8; 6] { w.to_le_bytes()[..6].try_into().expect("six bytes") };
        let v4 = batch::lookup_all::<ArpHeldKey, u64>(v4.map())?.into_iter().map(|(k, w)| ((k.ifindex, Ipv4Addr::from(k.vip).into()), mac(w)));
        let v6 = batch::lookup_all::<NdpHeldKey, u64>(v6.map())?.into_iter().map(|(k, w)| ((k.ifindex, Ipv6Addr::from(k.vip).into()), mac(w)));
        Ok(v4.chain(v6).collect())
    }

    /// Stops holding `vip`: no more ARP answers, but the entry stays (stale,
    /// deadline 0) so that clients still sending to our MAC (until the new
    /// owner's gratuitous ARP reaches them) keep being balanced: their pinned
    /// flows as pinned, new ones by the ring, as the new owner does. Frames from
    /// other nodes are passed, never forwarded again. `forget` removes it altogether.
    pub fn release(&mut self, ifindex: u32, vip: IpAddr) -> Result<()> {
        // Its slot first, which would say fresh until the old deadline.
        self.clear_slot(&key(ifindex, vip))?;
        // A stale holder asks no one (lb::lb_ask); a later takeover writes its own.
        self.end_handoff(ifindex, vip)?;
        let found = match key(ifindex, vip) {
            Key::V4(k) => self.held.get(&k, 0).and_then(|h| self.held.insert(k, HeldVip { deadline_ns: 0, ..h }, 0)),
            Key::V6(k) => self.held6.get(&k, 0).and_then(|h| self.held6.insert(k, HeldVip { deadline_ns: 0, ..h }, 0)),
        };
        match found {
            Ok(()) => {
                // Every answer after a release is taken from lb_flows, past the
                // stale entry's checks (it memoises none).
                self.epoch.bump()
            }
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e).context("releasing a held VIP"),
        }
    }

    /// Removes `vip`'s entry (the VIP left every pool).
    pub fn forget(&mut self, ifindex: u32, vip: IpAddr) -> Result<()> {
        self.forget_all(&[(ifindex, vip)])
    }

    /// Removes the entries of these (ifindex, VIP): one rewrite of
    /// `lb_held_filter` (a read of every entry) and one epoch bump for them all,
    /// so that a pool's VIPs leaving together cost the liveness thread one pass.
    /// Every removal is tried; the first failure is returned.
    pub fn forget_all(&mut self, gone: &[(u32, IpAddr)]) -> Result<()> {
        let mut failed = None;
        for &(ifindex, vip) in gone {
            if let Err(e) = self.clear_slot(&key(ifindex, vip)) {
                failed.get_or_insert(e.context(format!("emptying the held slot of {vip} on interface {ifindex}")));
                continue; // the entry stays, as its slot does
            }
            let removed = ignore_missing(match key(ifindex, vip) {
                Key::V4(k) => self.held.remove(&k),
                Key::V6(k) => self.held6.remove(&k),
            })
            .and_then(|()| self.end_handoff(ifindex, vip));
            if let Err(e) = removed {
                failed.get_or_insert(e.context(format!("forgetting {vip} on interface {ifindex}")));
            }
        }
        // Their cached flows must stop being forwarded; the bitmap, a hint, after.
        let bumped = self.epoch.bump();
        let synced = self.sync_held_filter();
        failed.map_or(Ok(()), Err).and(bumped).and(synced)
    }

    /// Empties the held slot of `key`'s VIP if it holds that key's copy (whoever wrote it).
    fn clear_slot(&mut self, key: &Key) -> Result<()> {
        match self.slots.as_mut() {
            Some(slots) => slots.clear(key),
            None => Ok(()),
        }
    }

    /// The keys in the held slots, as stored: (ifindex, VIP) → its copy's
    /// deadline and whether its check word holds. Fails on pins of an older agent.
    pub fn slot_entries(&self) -> Result<BTreeMap<(u32, IpAddr), (u64, bool)>> {
        let slots = self.slots.as_ref().context("lb4_held_slots is not pinned (an older agent's maps)")?;
        let mut out = BTreeMap::new();
        for s in batch::lookup_all::<u32, Lb4HeldSlot>(slots.v4.map())?.into_iter().map(|(_, s)| s).filter(|s| s.key != 0) {
            let k = ArpHeldKey { ifindex: s.key as u32, vip: ((s.key >> 32) as u32).to_le_bytes() };
            out.insert((k.ifindex, Ipv4Addr::from(k.vip).into()), (s.held.deadline_ns, Lb4HeldSlot::new(k, s.held) == s));
        }
        for s in batch::lookup_all::<u32, Lb6HeldSlot>(slots.v6.map())?.into_iter().map(|(_, s)| s).filter(|s| s.key != [0; 3]) {
            let mut vip = [0u8; 16];
            vip[..8].copy_from_slice(&s.key[1].to_le_bytes());
            vip[8..].copy_from_slice(&s.key[2].to_le_bytes());
            let k = NdpHeldKey { ifindex: s.key[0] as u32, vip };
            out.insert((k.ifindex, Ipv6Addr::from(vip).into()), (s.held.deadline_ns, Lb6HeldSlot::new(k, s.held) == s));
        }
        Ok(out)
    }

    /// Sets the `lb_held_filter` bits of `vips` before their entries are written
    /// (one write of the bitmap, only when a bit is new to this handle).
    fn mark_held(&mut self, vips: impl Iterator<Item = IpAddr>) -> Result<()> {
        let Some(filter) = self.held_filter.as_mut() else { return Ok(()) };
        let new = filter_bits(vips);
        if new.iter().zip(&self.held_bits).all(|(n, h)| n & !h == 0) {
            return Ok(());
        }
        let mut want = filter.get(&0, 0).context("reading lb_held_filter")?;
        want.iter_mut().zip(&new).for_each(|(w, n)| *w |= n);
        filter.set(0, want, 0).context("writing lb_held_filter")?;
        self.held_bits = want;
        Ok(())
    }

    /// Rewrites `lb_held_filter` from the entries left (after a removal).
    fn sync_held_filter(&mut self) -> Result<()> {
        if self.held_filter.is_none() {
            return Ok(());
        }
        let want = filter_bits(self.entries()?.into_iter().map(|e| e.vip));
        if let Some(filter) = self.held_filter.as_mut().filter(|_| want != self.held_bits) {
            filter.set(0, want, 0).context("writing lb_held_filter")?;
            self.held_bits = want;
        }
        Ok(())
    }

    /// The `lb_held_filter` bitmap as stored.
    pub fn held_filter(&self) -> Result<[u32; VIP_FILTER_WORDS as usize]> {
        let filter = self.held_filter.as_ref().context("lb_held_filter is not pinned (an older agent's maps)")?;
        Ok(filter.get(&0, 0)?)
    }

    /// Every held-VIP entry of both families, sorted (one batched read each).
    pub fn entries(&self) -> Result<Vec<HeldEntry>> {
        let entry = |ifindex, vip, h: HeldVip| HeldEntry { ifindex, vip, deadline_ns: h.deadline_ns, announce: HeldMode::from_flags(h.flags) };
        let v4 = batch::lookup_all::<ArpHeldKey, HeldVip>(self.held.map())?.into_iter().map(|(k, h)| entry(k.ifindex, Ipv4Addr::from(k.vip).into(), h));
        let v6 = batch::lookup_all::<NdpHeldKey, HeldVip>(self.held6.map())?.into_iter().map(|(k, h)| entry(k.ifindex, Ipv6Addr::from(k.vip).into(), h));
        let mut v: Vec<HeldEntry> = v4.chain(v6).collect();
        v.sort_by_key(|e| (e.ifindex, e.vip));
        Ok(v)
    }

    /// Conflicting claims seen per VIP on `ifindex` (counts since the entry
    /// appeared; one batched read).
    pub fn conflicts(&self, ifindex: u32) -> Result<BTreeMap<IpAddr, u64>> {
        let v4 = batch::lookup_all::<ArpHeldKey, u64>(self.conflicts.map())?
            .into_iter()
            .filter(|(k, _)| k.ifindex == ifindex)
            .map(|(k, n)| (Ipv4Addr::from(k.vip).into(), n));
        let v6 = batch::lookup_all::<NdpHeldKey, u64>(self.conflicts6.map())?
            .into_iter()
            .filter(|(k, _)| k.ifindex == ifindex)
            .map(|(k, n)| (Ipv6Addr::from(k.vip).into(), n));
        Ok(v4.chain(v6).collect())
    }

    /// Starts recording the ARP answers claiming `vip` on `ifindex` (an
    /// `arp_watch` entry, zeroed; the data path fills it). Fails when the maps
    /// were pinned by an agent without the ARP self-check.
    pub fn watch_arp(&mut self, ifindex: u32, vip: Ipv4Addr) -> Result<()> {
        let w = self.watch.as_mut().context("arp_watch is not pinned (an older agent's maps)")?;
        w.insert(ArpHeldKey { ifindex, vip: vip.octets() }, ArpWatch::default(), 0).context("writing arp_watch")
    }

    /// What was recorded for `vip` on `ifindex` since [`Self::watch_arp`]: the
    /// distinct sender MACs (at most ARP_WATCH_MACS) and how many claims in all;
    /// the entry is removed. None when it was not watched.
    pub fn take_arp_watch(&mut self, ifindex: u32, vip: Ipv4Addr) -> Result<Option<(Vec<[u8; 6]>, u32)>> {
        let Some(w) = self.watch.as_mut() else { return Ok(None) };
        let key = ArpHeldKey { ifindex, vip: vip.octets() };
        let got = match w.get(&key, 0) {
            Ok(v) => Some((v.macs[..(v.seen as usize).min(ARP_WATCH_MACS)].to_vec(), v.replies)),
            Err(aya::maps::MapError::KeyNotFound) => None,
            Err(e) => return Err(e).context("reading arp_watch"),
        };
        if got.is_some() {
            w.remove(&key).context("removing from arp_watch")?;
        }
        Ok(got)
    }

    /// Removes every `arp_watch` entry (those an earlier agent left mid-check).
    pub fn clear_arp_watch(&mut self) -> Result<()> {
        let Some(w) = self.watch.as_mut() else { return Ok(()) };
        let keys: Vec<ArpHeldKey> = w.keys().filter_map(|k| k.ok()).collect();
        for k in keys {
            // Gone meanwhile is fine: only this agent writes the map.
            let _ = w.remove(&k);
        }
        Ok(())
    }

    /// One reason's counter (packets, bytes) summed over CPUs: cheap enough to poll.
    pub fn reason_count(&self, r: Reason) -> Result<(u64, u64)> {
        sum(&self.stats, r as u32)
    }
}

/// A held-VIP key of either family: `arp_held`'s or `ndp_held`'s.
enum Key {
    V4(ArpHeldKey),
    V6(NdpHeldKey),
}

/// `lb4_held_slots` and `lb6_held_slots`: copies of held entries that the data
/// path finds with an inlined array lookup (vip_common::Lb4HeldSlot), the hash
/// maps staying the truth. A slot is written after its entry and emptied before
/// its entry is released, removed or given another MAC, so that it never says
/// fresher than the entry; with one writer (the liveness thread's handle) that
/// holds at every moment. Two VIPs of one slot: the first this handle wrote
/// keeps it, the other is found in the hash map.
struct HeldSlots {
    v4: Array<MapData, Lb4HeldSlot>,
    v6: Array<MapData, Lb6HeldSlot>,
    /// Slot → the key this handle wrote there.
    mine4: BTreeMap<u32, ArpHeldKey>,
    mine6: BTreeMap<u32, NdpHeldKey>,
}

impl HeldSlots {
    /// Both maps, or None (pins of an older agent: the data path it runs has none).
    fn open(dir: &Path) -> Option<Self> {
        Some(Self {
            v4: open_pinned(dir, names::HELD_SLOTS).ok()?,
            v6: open_pinned(dir, names::HELD_SLOTS6).ok()?,
            mine4: BTreeMap::new(),
            mine6: BTreeMap::new(),
        })
    }

    /// Copies these entries, just written, to their slots (one system call per family).
    fn write(&mut self, v4: &[(ArpHeldKey, HeldVip)], v6: &[(NdpHeldKey, HeldVip)]) -> Result<()> {
        let out4 = claim(&mut self.mine4, v4, |k| held_slot(vip_filter_bit(k.vip)), Lb4HeldSlot::new);
        let out6 = claim(&mut self.mine6, v6, |k| held_slot(vip_filter_bit6(k.vip)), Lb6HeldSlot::new);
        if !out4.is_empty() {
            batch::update(self.v4.map(), &out4).context("writing lb4_held_slots")?;
        }
        if !out6.is_empty() {
            batch::update(self.v6.map(), &out6).context("writing lb6_held_slots")?;
        }
        Ok(())
    }

    /// Empties `key`'s slot if it holds that key's copy.
    fn clear(&mut self, key: &Key) -> Result<()> {
        match key {
            Key::V4(k) => {
                let copy = Lb4HeldSlot::key_of(*k);
                empty(&mut self.v4, &mut self.mine4, held_slot(vip_filter_bit(k.vip)), k, |s| s.key == copy, names::HELD_SLOTS)
            }
            Key::V6(k) => {
                let copy = Lb6HeldSlot::key_of(*k);
                empty(&mut self.v6, &mut self.mine6, held_slot(vip_filter_bit6(k.vip)), k, |s| s.key == copy, names::HELD_SLOTS6)
            }
        }
    }
}

/// The slots of `entries` (index `slot`, copy `make`) that are free or theirs
/// already in `mine`, claimed there.
fn claim<K: Copy + PartialEq, S>(
    mine: &mut BTreeMap<u32, K>,
    entries: &[(K, HeldVip)],
    slot: impl Fn(&K) -> u32,
    make: impl Fn(K, HeldVip) -> S,
) -> Vec<(u32, S)> {
    entries.iter().filter(|(k, _)| *mine.entry(slot(k)).or_insert(*k) == *k).map(|(k, h)| (slot(k), make(*k, *h))).collect()
}

/// Slot `i` of `map` (named `name`) emptied if it holds `k`'s copy (`holds`), and
/// no longer `k`'s in `mine`.
fn empty<K: PartialEq, S: aya::Pod + Default>(
    map: &mut Array<MapData, S>,
    mine: &mut BTreeMap<u32, K>,
    i: u32,
    k: &K,
    holds: impl Fn(&S) -> bool,
    name: &str,
) -> Result<()> {
    if mine.get(&i) == Some(k) {
        mine.remove(&i);
    }
    if holds(&map.get(&i, 0).with_context(|| format!("reading {name}"))?) {
        map.set(i, S::default(), 0).with_context(|| format!("emptying a slot of {name}"))?;
    }
    Ok(())
}

fn key(ifindex: u32, vip: IpAddr) -> Key {
    match vip {
        IpAddr::V4(v) => Key::V4(ArpHeldKey { ifindex, vip: v.octets() }),
        IpAddr::V6(v) => Key::V6(NdpHeldKey { ifindex, vip: v.octets() }),
    }
}
