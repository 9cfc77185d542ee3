//! The one userspace facade over the XDP data path: load and attach, hold and
//! release VIPs (`held`), program services (shared Maglev rings, `rings`), read
//! counters.
//!
//! All state lives in maps pinned under one bpffs directory, so a restarted agent
//! re-opens them (and the still-attached program) without interrupting traffic.
//! Programming cost follows the change, not the world: services are applied as a
//! batch, rings are shared and written with batched map operations, and the flow
//! table is swept at most once per batch.
mod attach;
mod batch;
mod counters;
mod error;
mod flow_cache;
mod flows;
mod held;
#[cfg(test)]
mod pin_abi;
mod ring_alloc;
mod rings;
mod services;
mod testing;
mod xmit;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context as _, Result};
pub use attach::{detach, iface_info, keep_vlan_tags, link_up, pinned_links, AttachMode};
use aya::{
    maps::{Array, HashMap, IterableMap as _, Map, MapData, PerCpuArray},
    programs::Xdp,
    Ebpf,
};
pub use counters::Counters;
pub use error::DataplaneError;
pub use held::{HeldEntry, HeldMode, HeldVips};
pub use services::{backend_key, group_by_spec, Applied, BackendSpec, RingUpdate, ServiceSpec, Sweep, Usage};
use services::{service_addr, service_addr6};
use vip_common::{map_names as names, *};
pub use xmit::XdpXmit;

pub use crate::clock::monotonic_ns;
pub use crate::model::ServiceAddr;

/// The XDP object built by `cargo xtask build-ebpf`, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vip.bpf.o"));

pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/vip";

/// A service as programmed: its id and ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Programmed {
    id: u32,
    ring: u32,
}

pub struct Dataplane {
    dir: PathBuf,
    /// Present when this process loaded the object (attach, tests, bench).
    ebpf: Option<Ebpf>,
    held: HeldVips,
    services: HashMap<MapData, Lb4ServiceKey, LbService>,
    /// IPv6 services (their ids, rings and backends shared with IPv4's).
    services6: HashMap<MapData, Lb6ServiceKey, LbService>,
    backends: Array<MapData, LbBackend>,
    ring: Array<MapData, u32>,
    flows: flows::FlowTable,
    first_packets: Array<MapData, Lb4FirstPacket>,
    first_packets6: Array<MapData, Lb6FirstPacket>,
    stats: PerCpuArray<MapData, Counter>,
    service_stats: PerCpuArray<MapData, Counter>,
    backend_stats: PerCpuArray<MapData, Counter>,
    /// Bits of the addresses services use (see vip_common::vip_filter_bit), and
    /// its mirror (the words as written).
    vip_filter: Array<MapData, [u32; VIP_FILTER_WORDS as usize]>,
    vip_filter_words: [u32; VIP_FILTER_WORDS as usize],
    /// Bumped after every change a cached answer may depend on (see flow_cache).
    epoch: flow_cache::Ctl,
    rings: rings::Rings,
    /// Services as written to lb4_services (fragment aliases aside): a mirror
    /// rebuilt from the map on open.
    programmed: BTreeMap<ServiceAddr, Programmed>,
    /// Service ids in use.
    ids: BTreeSet<u32>,
    /// The slots of lb4_backends in use (a mirror of the array, rebuilt on open).
    backend_slots: BTreeMap<u32, LbBackend>,
    /// Per service, the backends out of its ring whose pinned flows stay
    /// (`ServiceSpec::draining`); their `lb4_backends` slots stay with them.
    draining: BTreeMap<ServiceAddr, BTreeSet<u32>>,
    /// The backends' MACs (`lb_nodes`), as `node_mac_key`s, and their mirror.
    nodes: HashMap<MapData, u64, u32>,
    node_keys: BTreeSet<u64>,
}

/// How much earlier than asked a held VIP goes stale in `arp_held`: two ticks of
/// CLOCK_MONOTONIC_COARSE. The data path reads the coarse clock
/// (`bpf_ktime_get_coarse_ns`, about 3 ns against 25 ns for `bpf_ktime_get_ns` on
/// these machines), which lags CLOCK_MONOTONIC by up to a tick; storing the
/// deadline two ticks early keeps the fencing promise: never answered past it.
pub fn coarse_slack_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC_COARSE exists on Linux.
    let res = if unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } == 0 {
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    } else {
        10_000_000 // HZ=100, the coarsest tick
    };
    2 * res
}

fn take<T: TryFrom<Map, Error = aya::maps::MapError>>(ebpf: &mut Ebpf, name: &str) -> Result<T> {
    let map = ebpf.take_map(name).ok_or_else(|| anyhow!("map {name} missing from the object"))?;
    T::try_from(map).with_context(|| format!("map {name} has an unexpected type"))
}

fn open_pinned<T: TryFrom<Map, Error = aya::maps::MapError>>(dir: &Path, name: &str) -> Result<T> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path)
        .with_context(|| format!("opening pinned map {} (nothing pinned there: has the agent started on this node?)", path.display()))?;
    let map = Map::from_map_data(data)?;
    T::try_from(map).with_context(|| format!("pinned map {} has an unexpected type", path.display()))
}

macro_rules! maps_from {
    ($src:expr, $get:ident) => {{
        let s = $src;
        (
            $get(s, names::SERVICES)?,
            $get(s, names::BACKENDS)?,
            $get(s, names::RING)?,
            $get(s, names::FLOWS)?,
            $get(s, names::FLOWS_CTL)?,
            $get(s, names::FIRST_PACKETS)?,
            $get(s, names::STATS)?,
            $get(s, names::SERVICE_STATS)?,
            $get(s, names::BACKEND_STATS)?,
            $get(s, names::VIP_FILTER)?,
            $get(s, names::SERVICES6)?,
            $get(s, names::FIRST_PACKETS6)?,
            $get(s, names::NODES)?,
        )
    }};
}

type MapSet = (
    HashMap<MapData, Lb4ServiceKey, LbService>,
    Array<MapData, LbBackend>,
    Array<MapData, u32>,
    Array<MapData, LbFlowSet>,
    Array<MapData, LbFlowsCtl>,
    Array<MapData, Lb4FirstPacket>,
    PerCpuArray<MapData, Counter>,
    PerCpuArray<MapData, Counter>,
    PerCpuArray<MapData, Counter>,
    Array<MapData, [u32; VIP_FILTER_WORDS as usize]>,
    HashMap<MapData, Lb6ServiceKey, LbService>,
    Array<MapData, Lb6FirstPacket>,
    HashMap<MapData, u64, u32>,
);

impl Dataplane {
    /// Loads the embedded object with its maps pinned under `dir` (re-using maps
    /// already pinned there) and its program loaded into the kernel, not attached.
    /// `ring_capacity` is only used when the ring map does not exist yet.
    pub fn load(dir: &Path, ring_capacity: u32) -> Result<Self> {
        ensure_bpffs_dir(dir)?;
        replace_outgrown_stats(dir)?;
        remove_obsolete_pins(dir)?;
        // The flow caches get the slots this machine's CPUs use (flow_cache_slots_for):
        // per-CPU arrays, they would otherwise grow with the CPUs at full size.
        let slots = flow_cache::slots()?;
        let mut ebpf = aya::EbpfLoader::new()
            .default_map_pin_directory(dir)
            .map_max_entries(names::RING, ring_capacity)
            .map_max_entries(names::FLOW_CACHE, slots)
            .map_max_entries(names::FLOW_CACHE6, slots)
            .load(OBJECT)
            .context("loading the XDP object (needs root or CAP_BPF)")?;
        let prog: &mut Xdp = ebpf.program_mut(PROGRAM_NAME).ok_or_else(|| anyhow!("program {PROGRAM_NAME} missing from the object"))?.try_into()?;
        prog.load().context("the kernel verifier rejected the XDP program")?;
        xmit::load_and_pin(&mut ebpf, dir)?;
        let m = maps_from!(&mut ebpf, take);
        let epoch = flow_cache::Ctl::new(take(&mut ebpf, names::FLOW_CACHE_CTL)?);
        epoch.configure()?;
        Self::from_maps(dir, Some(ebpf), m, epoch, true)
    }

    /// Opens the maps pinned under `dir` by a running or earlier agent.
    pub fn open(dir: &Path) -> Result<Self> {
        let m = maps_from!(dir, open_pinned);
        let epoch = flow_cache::Ctl::new(open_pinned(dir, names::FLOW_CACHE_CTL)?);
        Self::from_maps(dir, None, m, epoch, false)
    }

    /// `create`: this process loaded the object, and writes the flow table's hash
    /// key if the table is new (before the program is attached or replaces one).
    fn from_maps(dir: &Path, ebpf: Option<Ebpf>, m: MapSet, epoch: flow_cache::Ctl, create: bool) -> Result<Self> {
        let (services, backends, ring, flows, mut flows_ctl, first_packets, stats, service_stats, backend_stats, vip_filter, services6, first_packets6, nodes) =
            m;
        let flows = flows::FlowTable::new(flows, &mut flows_ctl, create)?;
        let mut dp = Self {
            dir: dir.to_owned(),
            ebpf,
            held: HeldVips::open(dir, epoch.clone())?,
            rings: rings::Rings::new(ring.len()),
            services,
            services6,
            backends,
            ring,
            flows,
            first_packets,
            first_packets6,
            stats,
            service_stats,
            backend_stats,
            vip_filter,
            vip_filter_words: [0; VIP_FILTER_WORDS as usize],
            epoch,
            programmed: BTreeMap::new(),
            ids: BTreeSet::new(),
            backend_slots: BTreeMap::new(),
            draining: BTreeMap::new(),
            nodes,
            node_keys: BTreeSet::new(),
        };
        dp.recover()?;
        Ok(dp)
    }

    /// Rebuilds the userspace mirrors (services, shared rings, backends) from the
    /// maps with batched reads, so that a restarted agent diffs against what
    /// packets see now.
    fn recover(&mut self) -> Result<()> {
        for (id, b) in batch::lookup_all::<u32, LbBackend>(self.backends.map())? {
            if b.flags & BACKEND_PRESENT != 0 {
                self.backend_slots.insert(id, b);
            }
        }
        let mut entries: Vec<(Option<ServiceAddr>, LbService)> =
            batch::lookup_all::<Lb4ServiceKey, LbService>(self.services.map())?.into_iter().map(|(k, s)| (service_addr(&k), s)).collect();
        entries.extend(batch::lookup_all::<Lb6ServiceKey, LbService>(self.services6.map())?.into_iter().map(|(k, s)| (service_addr6(&k), s)));
        // Fragment aliases (port 0) share their service's entry.
        let entries: Vec<(ServiceAddr, LbService)> = entries.into_iter().filter_map(|(a, s)| Some((a.filter(|a| a.port != 0)?, s))).collect();
        let regions: BTreeSet<(u32, u32)> = entries.iter().filter(|(_, s)| s.ring_size != 0).map(|(_, s)| (s.ring_offset, s.ring_size)).collect();
        // Only the regions in use are read (shared rings: usually a few).
        for (off, size) in regions {
            let slots = batch::array_range::<u32>(self.ring.map(), off, size).with_context(|| format!("reading ring region {off}+{size} of lb4_ring"))?;
            self.rings.insert(off, slots, true)?;
        }
        for (addr, svc) in entries {
            self.ids.insert(svc.id);
            self.rings.add_user(svc.ring_offset, addr);
            self.programmed.insert(addr, Programmed { id: svc.id, ring: svc.ring_offset });
        }
        // An older version's maps have no filter yet: it is written from the services.
        self.vip_filter_words = self.vip_filter.get(&0, 0).context("reading lb4_vip_filter")?;
        self.sync_vip_filter(std::iter::empty())?;
        // Nor node MACs: written from the backends.
        self.node_keys = self.nodes.keys().collect::<Result<_, _>>().context("reading lb_nodes")?;
        self.sync_nodes()
    }

    /// The held-VIP side of the maps.
    pub fn held(&mut self) -> &mut HeldVips {
        &mut self.held
    }

    pub fn held_ref(&self) -> &HeldVips {
        &self.held
    }

    /// A handle of its own on the held-VIP maps, for another thread.
    pub fn held_handle(&self) -> Result<HeldVips> {
        self.held.reopen(&self.dir)
    }

    /// Records the MAC of an interface the program runs on (attach does this).
    /// VIPs already held on it get the new MAC too.
    pub fn set_iface(&mut self, ifindex: u32, mac: [u8; 6]) -> Result<()> {
        self.held.write_iface(ifindex, mac, None)
    }

    pub fn iface_native(&self, ifindex: u32) -> bool {
        self.held.iface_native(ifindex)
    }

    /// [`HeldVips::set_vlan`].
    pub fn set_vlan(&mut self, parent: u32, vid: u16, ifindex: u32) -> Result<()> {
        self.held.set_vlan(parent, vid, ifindex)
    }

    /// [`HeldVips::set_home`].
    pub fn set_home(&mut self, home: Option<(u32, [u8; 6])>) -> Result<()> {
        self.held.set_home(home)
    }

    /// [`HeldVips::remove_vlan`].
    pub fn remove_vlan(&mut self, parent: u32, vid: u16) -> Result<()> {
        self.held.remove_vlan(parent, vid)
    }

    /// [`HeldVips::hold`], answered by ARP.
    pub fn hold_vip(&mut self, ifindex: u32, vip: impl Into<IpAddr>, deadline_ns: u64) -> Result<()> {
        self.held.hold(ifindex, vip.into(), deadline_ns, HeldMode::Arp)
    }

    /// [`HeldVips::release`].
    pub fn release_vip(&mut self, ifindex: u32, vip: impl Into<IpAddr>) -> Result<()> {
        self.held.release(ifindex, vip.into())
    }

    /// [`HeldVips::forget`].
    pub fn forget_vip(&mut self, ifindex: u32, vip: impl Into<IpAddr>) -> Result<()> {
        self.held.forget(ifindex, vip.into())
    }

    /// Held VIPs as (ifindex, vip, deadline_ns), the deadline as stored: the one
    /// the data path applies, [`coarse_slack_ns`] before the one asked for.
    pub fn held_vips(&self) -> Result<Vec<(u32, IpAddr, u64)>> {
        Ok(self.held.entries()?.into_iter().map(|e| (e.ifindex, e.vip, e.deadline_ns)).collect())
    }

    /// Attaches the loaded program to `iface` (see [`attach::attach`]).
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<attach::Attached> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf.as_mut().ok_or(DataplaneError::NotLoaded)?;
        let a = attach::attach(ebpf, &dir, iface, mode)?;
        // The attach mode, when known, is recorded with the MAC (IFACE_NATIVE).
        let flags = a.mode.map(|m| if m == AttachMode::Native { IFACE_NATIVE } else { 0 });
        self.held.write_iface(a.ifindex, a.mac, flags)?;
        Ok(a)
    }
}

fn reset_counter(map: &mut PerCpuArray<MapData, Counter>, i: u32) -> Result<()> {
    let n = aya::util::nr_cpus().map_err(|(_, e)| e)?;
    map.set(i, aya::maps::PerCpuValues::try_from(vec![Counter::default(); n])?, 0)?;
    Ok(())
}

/// The bitmap of `lb4_vip_filter` or `lb_held_filter` with the bits of `addrs` set.
fn filter_bits(addrs: impl Iterator<Item = IpAddr>) -> [u32; VIP_FILTER_WORDS as usize] {
    let mut words = [0u32; VIP_FILTER_WORDS as usize];
    for bit in addrs.map(vip_filter_bit_of) {
        words[(bit / 32) as usize] |= 1 << (bit % 32);
    }
    words
}

fn ignore_missing(r: Result<(), aya::maps::MapError>) -> Result<()> {
    match r {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        // A delete of a key not there fails with ENOENT.
        Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Maps an older version pinned that this one no longer uses: `lb4_flows_new`
/// (first-packet records, now `lb4_first_packets`) and `lb4_flows` (the LRU hash
/// flow table, now `lb_flows`). Their memory goes with the pin (and, for a map the
/// attached program still uses, with that program when [`attach`](Dataplane::attach) replaces it).
fn remove_obsolete_pins(dir: &Path) -> Result<()> {
    for name in ["lb4_flows_new", "lb4_flows", "lb6_flows"] {
        let path = dir.join(name);
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(map = name, "removed a map an older version pinned"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }
    Ok(())
}

/// `lb_stats` is indexed by [`Reason`], which grows between versions: a pinned
/// one left by an older version with fewer slots is replaced (its counts restart;
/// the running program keeps the old one until [`attach`](Dataplane::attach) replaces it). Kept, it
/// would leave the new reasons uncounted and make reading them fail.
fn replace_outgrown_stats(dir: &Path) -> Result<()> {
    let path = dir.join(names::STATS);
    let Ok(pinned) = MapData::from_pin(&path) else { return Ok(()) };
    let slots = pinned.info().with_context(|| format!("reading {}", path.display()))?.max_entries();
    if slots < Reason::COUNT {
        tracing::info!(map = names::STATS, slots, wanted = Reason::COUNT, "replacing a counter map from an older version (its counts restart)");
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(())
}

/// Makes sure `dir` is on a mounted bpffs and exists.
pub fn ensure_bpffs_dir(dir: &Path) -> Result<()> {
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let c = std::ffi::CString::new(probe.as_os_str().as_encoded_bytes())?;
    // SAFETY: valid C string and out pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 || st.f_type as i64 != 0xcafe4a11 {
        bail!("{} is not on a bpffs: mount one with `mount -t bpf bpf /sys/fs/bpf` (or run `cargo xtask setup`)", probe.display());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}
