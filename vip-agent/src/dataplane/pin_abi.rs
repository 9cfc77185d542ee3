//! The pinned maps as the object defines them, held to one list and to the
//! layout agents already running on nodes have pinned. An agent reuses the maps
//! it finds pinned (that is how flows and held VIPs outlive a restart), so a map
//! whose type, key, value, capacity or flags change between releases would be
//! reused with the wrong layout by the newer agent, or by the older one after a
//! rollback.

use std::collections::BTreeMap;

use aya_obj::{maps::PinningType, Object};
use vip_common::map_names;

use super::OBJECT;

/// (map type, key size, value size, max entries, flags) of a pinned map.
type Layout = (u32, u32, u32, u32, u32);

fn pinned_in_object() -> BTreeMap<String, Layout> {
    let obj = Object::parse(OBJECT).expect("the embedded XDP object parses");
    obj.maps
        .iter()
        .filter(|(_, m)| m.pinning() == PinningType::ByName)
        .map(|(name, m)| (name.clone(), (m.map_type(), m.key_size(), m.value_size(), m.max_entries(), m.map_flags())))
        .collect()
}

#[test]
fn every_pinned_map_of_the_object_is_in_the_one_list() {
    let object: Vec<String> = pinned_in_object().into_keys().collect();
    let mut listed: Vec<String> = map_names::ALL.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(object, listed, "the data path's pinned #[map]s and vip_common::map_names::ALL differ");
}

/// The layout pinned by the agents of this release, from the object. A change
/// here fails on purpose: before updating the table, make the agent migrate the
/// old pin on start (as `remove_obsolete_pins` and `replace_outgrown_stats` do),
/// with a test that starts on pins of the old layout, and say in the changelog
/// what a rollback past the change does.
const PINNED: &[(&str, Layout)] = &[
    // (name, (BPF_MAP_TYPE_*, key bytes, value bytes, max entries, BPF_F_*)).
    // `lb_stats` grows with `Reason` (a shorter pin is replaced: its counts
    // restart); `lb4_ring`'s capacity is the default, the agent sets its own.
    ("arp_conflicts", (9, 8, 8, 4096, 0)),
    ("arp_handoff", (1, 8, 8, 4096, 0)),
    ("arp_held", (1, 8, 16, 4096, 0)),
    ("arp_watch", (1, 8, 40, 256, 0)),
    ("lb4_backend_stats", (6, 4, 16, 4096, 0)),
    ("lb4_backends", (2, 4, 16, 4096, 0)),
    ("lb4_first_packets", (2, 4, 24, 16384, 0)),
    ("lb4_flow_cache", (6, 4, 56, 4096, 0)),
    ("lb4_flow_cache_ctl", (2, 4, 16, 1, 0)),
    ("lb4_held_slots", (2, 4, 32, 4096, 0)),
    ("lb4_ring", (2, 4, 4, 1048576, 0)),
    ("lb4_service_stats", (6, 4, 16, 16384, 0)),
    ("lb4_services", (1, 8, 16, 16384, 0)),
    ("lb4_vip_filter", (2, 4, 8192, 1, 0)),
    ("lb6_first_packets", (2, 4, 48, 16384, 0)),
    ("lb6_flow_cache", (6, 4, 80, 4096, 0)),
    ("lb6_held_slots", (2, 4, 48, 4096, 0)),
    ("lb6_services", (1, 20, 16, 16384, 0)),
    ("lb_flows", (2, 4, 64, 262144, 1024)),
    ("lb_flows_ctl", (2, 4, 16, 1, 0)),
    ("lb_held_filter", (2, 4, 8192, 1, 0)),
    ("lb_home", (2, 4, 12, 1, 0)),
    ("lb_ifaces", (1, 4, 8, 64, 0)),
    ("lb_nodes", (1, 8, 4, 4096, 0)),
    ("lb_stats", (6, 4, 16, 35, 0)),
    ("lb_vlans", (1, 8, 4, 256, 0)),
    ("ndp_conflicts", (9, 20, 8, 4096, 0)),
    ("ndp_handoff", (1, 20, 8, 4096, 0)),
    ("ndp_held", (1, 20, 16, 4096, 0)),
];

#[test]
fn pinned_maps_keep_the_layout_agents_already_pinned() {
    let object = pinned_in_object();
    let frozen: BTreeMap<String, Layout> = PINNED.iter().map(|(n, l)| (n.to_string(), *l)).collect();
    assert_eq!(object, frozen);
}
