//! The DaemonSet's memory limit covers the maps' charge on nodes of any size.
//!
//! A node's first agent creates the maps, and the kernel charges them to its pod's
//! memory cgroup; per-CPU maps grow with the possible CPUs. This test loads the
//! program as the agent does, checks `mapmem::charge` against what the kernel
//! reports for every map (fdinfo `memlock`), then computes the charge for 2 to 256
//! CPUs and checks that deploy/20-daemonset.yaml's limit covers the largest plus
//! the agent's own memory.
use vip_common::{flow_cache_slots_for, map_names};
use vip_tests::{
    kubeapi::deploy_dir,
    mapmem::{charge, pinned_maps, possible_cpus, quantity_bytes, MapDef, HEADER_SLACK},
    netns::{privileged, PinDir},
};

/// The agent's own memory besides the maps: 44.5 MiB was its largest measured
/// (1,000 Services and 100 Nodes on a real API server, BENCHMARKS.md).
const AGENT_OWN: u64 = 64 << 20;

#[test]
fn the_daemonset_limit_covers_the_maps_on_nodes_of_any_size() {
    if !privileged() {
        return;
    }
    let pins = PinDir::new().unwrap();
    let _dp = vip_agent::dataplane::Dataplane::load(&pins.path, vip_common::DEFAULT_RING_CAPACITY).unwrap();
    let maps = pinned_maps(&pins.path).unwrap();
    assert!(maps.len() >= vip_common::map_names::ALL.len(), "pinned: {:?}", maps.keys());
    let here = possible_cpus().unwrap();
    // The formula against the kernel, map by map: exact but for the fixed header.
    for (name, def) in &maps {
        let c = charge(def, here).unwrap_or_else(|| panic!("{name}: map type {} not modelled in mapmem::charge", def.map_type));
        assert!(c <= def.memlock && def.memlock <= c + HEADER_SLACK, "{name}: formula {c} bytes, kernel {} ({def:?})", def.memlock);
    }
    // The flow caches are created with the slots the machine's CPUs use.
    let sized = |name: &str, d: &MapDef, cpus: u64| match name {
        map_names::FLOW_CACHE | map_names::FLOW_CACHE6 => MapDef { max_entries: u64::from(flow_cache_slots_for(cpus as u32)), ..d.clone() },
        _ => d.clone(),
    };
    for name in [map_names::FLOW_CACHE, map_names::FLOW_CACHE6] {
        assert_eq!(maps[name].max_entries, u64::from(flow_cache_slots_for(here as u32)), "{name} sized for this machine");
    }
    let total = |cpus: u64| -> u64 { maps.iter().map(|(n, d)| charge(&sized(n, d, cpus), cpus).unwrap() + HEADER_SLACK).sum() };
    let measured: u64 = maps.values().map(|d| d.memlock).sum();
    eprintln!("maps here ({here} possible CPUs): {:.1} MiB by the kernel, {:.1} MiB by the formula", mib(measured), mib(total(here)));
    eprintln!("| possible CPUs | maps' charge (MiB) |\n|---:|---:|");
    for cpus in [2, 4, 8, 16, 32, 64, 128, 256] {
        eprintln!("| {cpus} | {:.1} |", mib(total(cpus)));
    }

    let ds: serde_json::Value = serde_yaml_ng::from_str(&std::fs::read_to_string(deploy_dir().join("20-daemonset.yaml")).unwrap()).unwrap();
    let limit = ds["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"].as_str().expect("a memory limit on the agent container");
    let limit = quantity_bytes(limit).unwrap();
    let need = total(256) + AGENT_OWN;
    assert!(
        limit >= need,
        "deploy/20-daemonset.yaml limits the agent to {:.0} MiB; a 256-CPU node's first agent needs {:.0} MiB (maps {:.0} + its own {:.0})",
        mib(limit),
        mib(need),
        mib(total(256)),
        mib(AGENT_OWN)
    );
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}
