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
mod flow_cache;
mod held;
mod ring_alloc;
mod rings;
mod xmit;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
pub use attach::{detach, iface_info, AttachMode};
use aya::{
    maps::{Array, HashMap, IterableMap as _, Map, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions, Xdp},
    Ebpf,
};
pub use held::{Announce, HeldEntry, HeldVips};
use vip_common::{map_names as names, *};
pub use xmit::XdpXmit;

pub use crate::clock::monotonic_ns;
pub use crate::model::ServiceAddr;
use crate::{
    maglev::{self, Member},
    model::Protocol,
};

/// The XDP object built by `cargo xtask build-ebpf`, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vip.bpf.o"));

pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/vip";

/// A backend node as the data path needs it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackendSpec {
    /// Stable identity (node name): the Maglev permutation is derived from it.
    pub name: String,
    pub addr: Ipv4Addr,
    pub mac: [u8; 6],
    pub weight: u32,
    /// This node itself: matching packets are passed to the local stack.
    pub local: bool,
}

/// The `lb4_services` key of a service-port.
fn service_key(a: &ServiceAddr) -> ServiceKey {
    ServiceKey { vip: a.vip.octets(), port: a.port.to_be_bytes(), proto: a.protocol.number(), _pad: 0 }
}

/// The service-port of an `lb4_services` key (None: a protocol we never write).
fn service_addr(k: &ServiceKey) -> Option<ServiceAddr> {
    Some(ServiceAddr { vip: Ipv4Addr::from(k.vip), port: u16::from_be_bytes(k.port), protocol: Protocol::from_number(k.proto)? })
}

/// What a service should be: its backends and ring size.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceSpec {
    pub backends: Vec<BackendSpec>,
    pub table_size: u32,
}

/// What one `set_service` call wrote.
#[derive(Clone, Debug, Default)]
pub struct RingUpdate {
    pub slots_written: usize,
    pub table_size: u32,
    pub elapsed: Duration,
}

/// The outcome of [`Dataplane::apply`]: each service either programmed or not,
/// on its own (a service that does not fit never stops the others).
#[derive(Debug, Default)]
pub struct Applied {
    /// Services now pointing at their new ring, with the slots written for them
    /// (0 when they joined a ring another service already had).
    pub written: BTreeMap<ServiceAddr, usize>,
    pub removed: Vec<ServiceAddr>,
    /// Services left as they were (or absent), with why.
    pub failed: BTreeMap<ServiceAddr, String>,
    /// Time spent writing rings, services and backends.
    pub write_time: Duration,
    /// The flows to evict next ([`Dataplane::sweep`]).
    pub sweep: Sweep,
}

/// Flows a batch left pinned where they should no longer go.
#[derive(Debug, Default)]
pub struct Sweep {
    /// Services that lost backends → the backends they kept.
    lost: StdHashMap<ServiceAddr, BTreeSet<u32>>,
    /// Backends no service has any more.
    gone: BTreeSet<u32>,
}

impl Sweep {
    pub fn is_empty(&self) -> bool {
        self.lost.is_empty() && self.gone.is_empty()
    }
}

/// How full the data path's tables are.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub services: usize,
    pub services_max: u32,
    pub rings: usize,
    pub ring_slots: u64,
    pub ring_capacity: u32,
    pub backends: usize,
    pub backends_max: u32,
}

/// Summed counters.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Counters {
    pub reasons: BTreeMap<&'static str, (u64, u64)>,
    pub services: BTreeMap<u32, (u64, u64)>,
    pub backends: BTreeMap<u32, (u64, u64)>,
}

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
    services: HashMap<MapData, ServiceKey, Service>,
    backends: Array<MapData, Backend>,
    ring: Array<MapData, u32>,
    flows: HashMap<MapData, FlowKey, Flow>,
    stats: PerCpuArray<MapData, Counter>,
    service_stats: PerCpuArray<MapData, Counter>,
    backend_stats: PerCpuArray<MapData, Counter>,
    /// Bumped after every change a cached answer may depend on (see flow_cache).
    epoch: flow_cache::Ctl,
    rings: rings::Rings,
    /// Services as written to lb4_services (fragment aliases aside): a mirror
    /// rebuilt from the map on open.
    programmed: BTreeMap<ServiceAddr, Programmed>,
    /// Service ids in use.
    ids: BTreeSet<u32>,
    /// The slots of lb4_backends in use (a mirror of the array, rebuilt on open).
    backend_slots: BTreeMap<u32, Backend>,
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
    let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {} (is the program loaded? run `vip-agent attach`)", path.display()))?;
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
            $get(s, names::STATS)?,
            $get(s, names::SERVICE_STATS)?,
            $get(s, names::BACKEND_STATS)?,
        )
    }};
}

type MapSet = (
    HashMap<MapData, ServiceKey, Service>,
    Array<MapData, Backend>,
    Array<MapData, u32>,
    HashMap<MapData, FlowKey, Flow>,
    PerCpuArray<MapData, Counter>,
    PerCpuArray<MapData, Counter>,
    PerCpuArray<MapData, Counter>,
);

impl Dataplane {
    /// Loads the embedded object with its maps pinned under `dir` (re-using maps
    /// already pinned there) and its program loaded into the kernel, not attached.
    /// `ring_capacity` is only used when the ring map does not exist yet.
    pub fn load(dir: &Path, ring_capacity: u32) -> Result<Self> {
        ensure_bpffs_dir(dir)?;
        let mut ebpf = aya::EbpfLoader::new()
            .default_map_pin_directory(dir)
            .map_max_entries(names::RING, ring_capacity)
            .load(OBJECT)
            .context("loading the XDP object (needs root or CAP_BPF)")?;
        let prog: &mut Xdp = ebpf.program_mut(PROGRAM_NAME).ok_or_else(|| anyhow!("program {PROGRAM_NAME} missing from the object"))?.try_into()?;
        prog.load().context("the kernel verifier rejected the XDP program")?;
        xmit::load_and_pin(&mut ebpf, dir)?;
        let m = maps_from!(&mut ebpf, take);
        let epoch = flow_cache::Ctl::new(take(&mut ebpf, names::FLOW_CACHE_CTL)?);
        epoch.configure()?;
        Self::from_maps(dir, Some(ebpf), m, epoch)
    }

    /// Opens the maps pinned under `dir` by a running or earlier agent.
    pub fn open(dir: &Path) -> Result<Self> {
        let m = maps_from!(dir, open_pinned);
        let epoch = flow_cache::Ctl::new(open_pinned(dir, names::FLOW_CACHE_CTL)?);
        Self::from_maps(dir, None, m, epoch)
    }

    fn from_maps(dir: &Path, ebpf: Option<Ebpf>, m: MapSet, epoch: flow_cache::Ctl) -> Result<Self> {
        let (services, backends, ring, flows, stats, service_stats, backend_stats) = m;
        let mut dp = Self {
            dir: dir.to_owned(),
            ebpf,
            held: HeldVips::open(dir, epoch.clone())?,
            rings: rings::Rings::new(ring.len()),
            services,
            backends,
            ring,
            flows,
            stats,
            service_stats,
            backend_stats,
            epoch,
            programmed: BTreeMap::new(),
            ids: BTreeSet::new(),
            backend_slots: BTreeMap::new(),
        };
        dp.recover()?;
        Ok(dp)
    }

    /// Rebuilds the userspace mirrors (services, shared rings, backends) from the
    /// maps with batched reads, so that a restarted agent diffs against what
    /// packets see now.
    fn recover(&mut self) -> Result<()> {
        for (id, b) in batch::lookup_all::<u32, Backend>(self.backends.map())? {
            if b.flags & BACKEND_PRESENT != 0 {
                self.backend_slots.insert(id, b);
            }
        }
        let entries = batch::lookup_all::<ServiceKey, Service>(self.services.map())?;
        let regions: BTreeSet<(u32, u32)> =
            entries.iter().filter(|(k, s)| k.port != [0, 0] && s.ring_size != 0).map(|(_, s)| (s.ring_offset, s.ring_size)).collect();
        // Only the regions in use are read (shared rings: usually a few).
        for (off, size) in regions {
            let slots = batch::array_range::<u32>(self.ring.map(), off, size).with_context(|| format!("reading ring region {off}+{size} of lb4_ring"))?;
            self.rings.insert(off, slots, true)?;
        }
        for (key, svc) in entries {
            if key.port == [0, 0] {
                continue; // fragment alias: shares its service's entry
            }
            let Some(addr) = service_addr(&key) else { continue };
            self.ids.insert(svc.id);
            self.rings.add_user(svc.ring_offset, addr);
            self.programmed.insert(addr, Programmed { id: svc.id, ring: svc.ring_offset });
        }
        Ok(())
    }

    pub fn pin_dir(&self) -> &Path {
        &self.dir
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

    /// Runs the program once (or `repeat` times) on `frame` with BPF_PROG_TEST_RUN.
    /// Returns the verdict, the output frame and the mean duration per run.
    /// `live_batch`: run in live-frames mode (frames really go out), batch size.
    pub fn test_run(&mut self, frame: &[u8], repeat: u32, live_batch: Option<u32>) -> Result<(u32, Vec<u8>, Duration)> {
        self.test_run_program(PROGRAM_NAME, frame, repeat, live_batch)
    }

    /// [`Self::test_run`] for any XDP program of the object (loaded on first use),
    /// e.g. the benchmark's `xdp_baseline_pass`.
    pub fn test_run_program(&mut self, name: &str, frame: &[u8], repeat: u32, live_batch: Option<u32>) -> Result<(u32, Vec<u8>, Duration)> {
        let mut out = vec![0u8; frame.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat.max(1);
        if let Some(batch) = live_batch {
            opts.attrs = aya::programs::TestRunAttrs::new().xdp_live_frames(batch);
        } else {
            opts.data_out = Some(&mut out);
        }
        let ebpf = self.ebpf.as_mut().ok_or_else(|| anyhow!("program not loaded by this process"))?;
        let prog: &mut Xdp = ebpf.program_mut(name).ok_or_else(|| anyhow!("no program {name} in the object"))?.try_into()?;
        if prog.fd().is_err() {
            prog.load()?;
        }
        let r = prog.test_run(opts)?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out, r.duration))
    }

    /// Records the MAC of an interface the program runs on (attach does this).
    /// VIPs already held on it get the new MAC too.
    pub fn set_iface(&mut self, ifindex: u32, mac: [u8; 6]) -> Result<()> {
        self.held.write_iface(ifindex, mac, None)
    }

    pub fn iface_native(&self, ifindex: u32) -> bool {
        self.held.iface_native(ifindex)
    }

    pub fn remove_iface(&mut self, ifindex: u32) -> Result<()> {
        self.held.remove_iface(ifindex)
    }

    /// [`HeldVips::hold`], answered by ARP.
    pub fn hold_vip(&mut self, ifindex: u32, vip: Ipv4Addr, deadline_ns: u64) -> Result<()> {
        self.held.hold(ifindex, vip, deadline_ns, Announce::Arp)
    }

    /// [`HeldVips::release`].
    pub fn release_vip(&mut self, ifindex: u32, vip: Ipv4Addr) -> Result<()> {
        self.held.release(ifindex, vip)
    }

    /// [`HeldVips::forget`].
    pub fn forget_vip(&mut self, ifindex: u32, vip: Ipv4Addr) -> Result<()> {
        self.held.forget(ifindex, vip)
    }

    /// Held VIPs as (ifindex, vip, deadline_ns), the deadline as stored: the one
    /// the data path applies, [`coarse_slack_ns`] before the one asked for.
    pub fn held_vips(&self) -> Result<Vec<(u32, Ipv4Addr, u64)>> {
        Ok(self.held.entries()?.into_iter().map(|e| (e.ifindex, e.vip, e.deadline_ns)).collect())
    }

    /// Services as (address, entry, ring) for inspection, from the mirrors.
    pub fn services(&self) -> Result<Vec<(ServiceAddr, Service, Vec<u32>)>> {
        Ok(self
            .programmed
            .iter()
            .map(|(a, p)| {
                let ring = self.rings.get(p.ring).map(|r| r.slots.clone()).unwrap_or_default();
                (*a, Service { id: p.id, ring_offset: p.ring, ring_size: ring.len() as u32, _pad: 0 }, ring)
            })
            .collect())
    }

    /// The services programmed now.
    pub fn service_addrs(&self) -> BTreeSet<ServiceAddr> {
        self.programmed.keys().copied().collect()
    }

    /// Backends in use (slots of `lb4_backends` with `BACKEND_PRESENT`), by id.
    pub fn backends(&self) -> Result<BTreeMap<u32, Backend>> {
        Ok(self.backend_slots.clone())
    }

    /// How full the tables are.
    pub fn usage(&self) -> Usage {
        Usage {
            services: self.programmed.len(),
            services_max: MAX_SERVICES,
            rings: self.rings.len(),
            ring_slots: self.rings.used_slots(),
            ring_capacity: self.rings.capacity(),
            backends: self.backend_slots.len(),
            backends_max: MAX_BACKENDS,
        }
    }

    /// Backend id for `spec`, re-using the id of a backend with the same address,
    /// else the lowest free slot of `lb4_backends`.
    fn backend_id(&mut self, spec: &BackendSpec) -> Result<u32> {
        let want = Backend { mac: spec.mac, _pad: [0; 2], addr: spec.addr.octets(), flags: BACKEND_PRESENT | if spec.local { BACKEND_LOCAL } else { 0 } };
        let existing = &self.backend_slots;
        let id = match existing.iter().find(|(_, b)| b.addr == want.addr) {
            Some((&id, _)) => id,
            None => (0..MAX_BACKENDS).find(|id| !existing.contains_key(id)).ok_or_else(|| anyhow!("all {MAX_BACKENDS} backend ids are in use"))?,
        };
        if existing.get(&id) != Some(&want) {
            self.backends.set(id, want, 0)?;
            self.backend_slots.insert(id, want);
        }
        Ok(id)
    }

    /// Sets the backends of one service (see [`Self::apply`]); its error if it failed.
    pub fn set_service(&mut self, addr: ServiceAddr, backends: &[BackendSpec], table_size: u32, seed: u64) -> Result<RingUpdate> {
        let start = Instant::now();
        let spec = ServiceSpec { backends: backends.to_vec(), table_size };
        let mut a = self.apply(&BTreeMap::from([(addr, &spec)]), &[], seed)?;
        if let Some(e) = a.failed.remove(&addr) {
            bail!("{e}");
        }
        self.sweep(&a.sweep)?;
        let slots_written = a.written.get(&addr).copied().unwrap_or(0);
        Ok(RingUpdate { slots_written, table_size, elapsed: start.elapsed() })
    }

    /// Removes a service, its ring when no other service shares it, and any
    /// backend only it used (with their flows).
    pub fn remove_service(&mut self, addr: ServiceAddr) -> Result<()> {
        let a = self.apply(&BTreeMap::new(), &[addr], 0)?;
        self.sweep(&a.sweep).map(|_| ())
    }

    /// Programs a batch of changes: `set` services get the rings their specs
    /// build, `remove` ones go; the flows to evict are returned, for
    /// [`Self::sweep`]. Each service succeeds or fails on its own (a full
    /// ring map or service table is reported in [`Applied::failed`] and leaves that
    /// service as it was); an `Err` is a map operation the kernel refused.
    ///
    /// Order, so that packets never see a half-written ring: backend entries
    /// first; a ring shared with services that do not move is never written (a
    /// new region is filled, then services are pointed at it); a ring whose every
    /// user moves to the same new content is rewritten in place, changed slots
    /// only (Maglev keeps those few), each slot pointing at a written backend.
    /// Then service entries, fragment aliases, freed rings and backends, and one
    /// flow-cache epoch bump.
    pub fn apply(&mut self, set: &BTreeMap<ServiceAddr, &ServiceSpec>, remove: &[ServiceAddr], seed: u64) -> Result<Applied> {
        let start = Instant::now();
        let mut out = Applied::default();
        // New content → the services that want it.
        let mut groups: BTreeMap<Vec<u32>, Vec<ServiceAddr>> = BTreeMap::new();
        // Maglev builds are the CPU cost: services with equal specs (thousands,
        // under one node set) build one ring.
        let mut by_spec: StdHashMap<&ServiceSpec, Vec<ServiceAddr>> = StdHashMap::new();
        for (&addr, spec) in set {
            by_spec.entry(*spec).or_default().push(addr);
        }
        for (spec, addrs) in by_spec {
            match self.ring_for(spec, seed) {
                Ok(slots) => groups.entry(slots).or_default().extend(addrs),
                Err(e) => {
                    for addr in addrs {
                        out.failed.insert(addr, format!("{e:#}"));
                    }
                }
            }
        }
        // Backends each changed service keeps (for the sweep), and whether it lost some.
        let mut lost: StdHashMap<ServiceAddr, BTreeSet<u32>> = StdHashMap::new();
        let mut touched: BTreeSet<ServiceAddr> = BTreeSet::new();
        for (slots, users) in groups {
            let (offset, written, was) = match self.place_ring(&slots, &users) {
                Ok(t) => t,
                Err(e) => {
                    for a in users {
                        out.failed.insert(a, format!("{e:#}"));
                    }
                    continue;
                }
            };
            let kept: BTreeSet<u32> = self.rings.get(offset).map(|r| r.members.clone()).unwrap_or_default();
            let mut first = true;
            for addr in users {
                let cur = self.programmed.get(&addr).copied();
                let before = match cur {
                    Some(p) if p.ring == offset => was.clone(), // rewritten in place (or unchanged)
                    Some(p) => self.rings.get(p.ring).map(|r| r.members.clone()),
                    None => None,
                };
                if before.is_some_and(|b| !b.is_subset(&kept)) {
                    lost.insert(addr, kept.clone());
                }
                if cur.is_some_and(|p| p.ring == offset) {
                    if written > 0 && first {
                        out.written.insert(addr, written);
                        first = false;
                    }
                    continue;
                }
                let id = match cur {
                    Some(p) => p.id,
                    None => match self.free_service_id() {
                        Some(id) => id,
                        None => {
                            out.failed.insert(addr, format!("all {MAX_SERVICES} service ids are in use"));
                            continue;
                        }
                    },
                };
                let entry = Service { id, ring_offset: offset, ring_size: slots.len() as u32, _pad: 0 };
                if let Err(e) = self.services.insert(service_key(&addr), entry, 0) {
                    out.failed.insert(addr, format!("writing lb4_services: {e}"));
                    continue;
                }
                self.ids.insert(id);
                self.rings.add_user(offset, addr);
                if let Some(p) = cur {
                    self.rings.drop_user(p.ring, addr);
                }
                self.programmed.insert(addr, Programmed { id, ring: offset });
                out.written.insert(addr, if first { written } else { 0 });
                touched.insert(addr);
                first = false;
            }
            // A new region nobody took (every user failed) goes back.
            self.rings.free_if_unused(offset);
        }
        for &addr in remove {
            let Some(p) = self.programmed.remove(&addr) else { continue };
            ignore_missing(self.services.remove(&service_key(&addr)))?;
            self.rings.drop_user(p.ring, addr);
            self.ids.remove(&p.id);
            reset_counter(&mut self.service_stats, p.id)?;
            touched.insert(addr);
            out.removed.push(addr);
        }
        let aliases: BTreeSet<(Ipv4Addr, Protocol)> = touched.iter().map(|a| (a.vip, a.protocol)).collect();
        for (vip, protocol) in aliases {
            self.update_fragment_alias(vip, protocol)?;
        }
        let gone = self.collect_backends()?;
        self.epoch.bump()?;
        out.write_time = start.elapsed();
        out.sweep = Sweep { lost, gone };
        Ok(out)
    }

    /// Evicts the flows a batch left pinned to a backend their service lost (or
    /// that no service has any more), in one batched pass over the flow table:
    /// they re-hash on their next packet. Separate from [`Self::apply`] so that
    /// callers can tell "rings written" from "flows swept".
    pub fn sweep(&mut self, sweep: &Sweep) -> Result<usize> {
        if sweep.is_empty() {
            return Ok(0);
        }
        let Sweep { lost, gone } = sweep;
        // Fragment flows (port 0) of a VIP follow its services' kept sets.
        let mut by_vip: StdHashMap<([u8; 4], u8), Vec<&BTreeSet<u32>>> = StdHashMap::new();
        for (a, kept) in lost {
            by_vip.entry((a.vip.octets(), a.protocol.number())).or_default().push(kept);
        }
        self.evict_flows(|k, f| {
            if gone.contains(&f.backend) {
                return true;
            }
            if k.dport == [0, 0] {
                return by_vip.get(&(k.dst, k.proto)).is_some_and(|v| v.iter().any(|kept| !kept.contains(&f.backend)));
            }
            let Some(protocol) = Protocol::from_number(k.proto) else { return false };
            let addr = ServiceAddr { vip: Ipv4Addr::from(k.dst), port: u16::from_be_bytes(k.dport), protocol };
            lost.get(&addr).is_some_and(|kept| !kept.contains(&f.backend))
        })
    }

    /// The ring `spec` builds, as backend ids per slot (writing backend entries).
    fn ring_for(&mut self, spec: &ServiceSpec, seed: u64) -> Result<Vec<u32>> {
        maglev::check_table_size(spec.table_size)?;
        if spec.backends.is_empty() {
            return Ok(vec![NO_BACKEND; spec.table_size as usize]);
        }
        let mut specs: Vec<&BackendSpec> = spec.backends.iter().collect();
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        let members: Vec<Member> = specs.iter().map(|b| Member { id: b.name.clone(), weight: b.weight.max(1) }).collect();
        let built = maglev::build(&members, spec.table_size, seed)?;
        // Backend ids in sorted-name order, as maglev::build sorts its members.
        let mut ids = Vec::with_capacity(specs.len());
        for b in specs {
            ids.push(self.backend_id(b)?);
        }
        Ok(built.slots.iter().map(|&i| ids[i as usize]).collect())
    }

    /// Where `slots` goes for `users`: (offset, slots written, the members the
    /// ring had when it was rewritten in place). An equal ring is shared; a ring
    /// all of whose users move here is rewritten in place; else a new region is
    /// filled.
    fn place_ring(&mut self, slots: &[u32], users: &[ServiceAddr]) -> Result<(u32, usize, Option<BTreeSet<u32>>)> {
        if let Some(off) = self.rings.find(slots) {
            let members = self.rings.get(off).map(|r| r.members.clone());
            return Ok((off, 0, members));
        }
        let moving: BTreeSet<&ServiceAddr> = users.iter().collect();
        let in_place = users
            .iter()
            .filter_map(|a| self.programmed.get(a))
            .map(|p| p.ring)
            .find(|&off| self.rings.get(off).is_some_and(|r| r.slots.len() == slots.len() && r.users.iter().all(|u| moving.contains(u))));
        if let Some(off) = in_place {
            let old = self.rings.get(off).expect("found");
            let members = old.members.clone();
            let changes: Vec<(u32, u32)> = maglev::changed_slots(&old.slots, slots).into_iter().map(|(i, b)| (off + i, b)).collect();
            batch::update(self.ring.map(), &changes).context("writing lb4_ring")?;
            self.rings.recontent(off, slots.to_vec());
            return Ok((off, changes.len(), Some(members)));
        }
        let off = self.rings.alloc(slots.len() as u32)?;
        let entries: Vec<(u32, u32)> = slots.iter().enumerate().map(|(i, &b)| (off + i as u32, b)).collect();
        if let Err(e) = batch::update(self.ring.map(), &entries) {
            self.rings.unalloc(off);
            return Err(e).context("writing lb4_ring");
        }
        self.rings.insert(off, slots.to_vec(), false)?;
        Ok((off, slots.len(), None))
    }

    fn free_service_id(&self) -> Option<u32> {
        (0..MAX_SERVICES).find(|i| !self.ids.contains(i))
    }

    /// Points (vip, port 0, proto), the entry fragments use, at the service with the
    /// lowest port of that VIP and protocol (or removes it when there is none).
    fn update_fragment_alias(&mut self, vip: Ipv4Addr, protocol: Protocol) -> Result<()> {
        let alias = ServiceAddr { vip, port: 0, protocol };
        let first = self
            .programmed
            .range(alias..=ServiceAddr { vip, port: u16::MAX, protocol: Protocol::Udp })
            .find(|(a, _)| a.protocol == protocol && a.port != 0)
            .map(|(_, p)| *p);
        match first {
            Some(p) => {
                let size = self.rings.get(p.ring).map_or(0, |r| r.size());
                self.services.insert(service_key(&alias), Service { id: p.id, ring_offset: p.ring, ring_size: size, _pad: 0 }, 0)?;
            }
            None => ignore_missing(self.services.remove(&service_key(&alias)))?,
        }
        Ok(())
    }

    /// Deletes backends no ring references and returns their ids; the caller
    /// evicts their flows (in the same pass as any other eviction it needs).
    fn collect_backends(&mut self) -> Result<BTreeSet<u32>> {
        let used = self.rings.used_backends();
        let gone: BTreeSet<u32> = self.backend_slots.keys().copied().filter(|id| !used.contains(id)).collect();
        for id in &gone {
            // A zeroed slot (no BACKEND_PRESENT) is no backend: flows to it re-hash.
            self.backends.set(*id, Backend::default(), 0)?;
            self.backend_slots.remove(id);
            reset_counter(&mut self.backend_stats, *id)?;
        }
        Ok(gone)
    }

    /// Removes flow-table entries matching `pred` (one batched walk, batched
    /// deletes); returns how many.
    pub fn evict_flows(&mut self, pred: impl Fn(&FlowKey, &Flow) -> bool) -> Result<usize> {
        let stale: Vec<FlowKey> = batch::lookup_all::<FlowKey, Flow>(self.flows.map())?.into_iter().filter(|(k, f)| pred(k, f)).map(|(k, _)| k).collect();
        let n = if stale.is_empty() { 0 } else { batch::delete(self.flows.map(), &stale)? };
        self.epoch.bump()?; // cached copies of the removed flows
        Ok(n)
    }

    /// Writes flow-table entries as the data path would on first packets: how
    /// tests and benchmarks fill `lb4_flows` to real scale without sending a
    /// million packets.
    pub fn insert_flows(&mut self, flows: &[(FlowKey, Flow)]) -> Result<()> {
        batch::update(self.flows.map(), flows).context("writing lb4_flows")
    }

    /// The flow cache's epoch (`lb4_flow_cache_ctl`): bumped each time cached answers are invalidated.
    pub fn flow_cache_epoch(&self) -> Result<u64> {
        self.epoch.epoch()
    }

    pub fn flow_count(&self) -> usize {
        batch::lookup_all::<FlowKey, Flow>(self.flows.map()).map_or(0, |v| v.len())
    }

    /// Sums the per-CPU counters.
    pub fn counters(&self) -> Result<Counters> {
        let mut c = Counters::default();
        for r in Reason::ALL {
            c.reasons.insert(r.name(), sum(&self.stats, r as u32)?);
        }
        // From the maps, not the mirrors: a handle opened for reading (the metrics
        // endpoint, inspect) sees services another handle programmed since. Two
        // batched reads, then one read per id.
        let ids: BTreeSet<u32> = batch::lookup_all::<ServiceKey, Service>(self.services.map())?.into_iter().map(|(_, s)| s.id).collect();
        for id in ids {
            c.services.insert(id, sum(&self.service_stats, id)?);
        }
        for (id, b) in batch::lookup_all::<u32, Backend>(self.backends.map())? {
            if b.flags & BACKEND_PRESENT != 0 {
                c.backends.insert(id, sum(&self.backend_stats, id)?);
            }
        }
        Ok(c)
    }

    /// One reason's counter (packets, bytes) summed over CPUs: cheap enough to poll.
    pub fn reason_count(&self, r: Reason) -> Result<(u64, u64)> {
        sum(&self.stats, r as u32)
    }

    /// Attaches the loaded program to `iface` (see [`attach::attach`]).
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<attach::Attached> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf.as_mut().ok_or_else(|| anyhow!("program not loaded by this process"))?;
        let a = attach::attach(ebpf, &dir, iface, mode)?;
        // The attach mode, when known, is recorded with the MAC (IFACE_NATIVE).
        let flags = a.mode.map(|m| if m == AttachMode::Native { IFACE_NATIVE } else { 0 });
        self.held.write_iface(a.ifindex, a.mac, flags)?;
        Ok(a)
    }
}

fn sum(map: &PerCpuArray<MapData, Counter>, i: u32) -> Result<(u64, u64)> {
    let v = map.get(&i, 0)?;
    Ok(v.iter().fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes)))
}

fn reset_counter(map: &mut PerCpuArray<MapData, Counter>, i: u32) -> Result<()> {
    let n = aya::util::nr_cpus().map_err(|(_, e)| e)?;
    map.set(i, aya::maps::PerCpuValues::try_from(vec![Counter::default(); n])?, 0)?;
    Ok(())
}

fn ignore_missing(r: Result<(), aya::maps::MapError>) -> Result<()> {
    match r {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(e) => Err(e.into()),
    }
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
