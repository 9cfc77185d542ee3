use k8s_openapi::jiff::Timestamp;

use super::*;
use crate::k8s::reports::HELD;

/// A pool's unheld VIPs are grouped by why, one group per reason, each
/// naming its VIPs.
#[test]
fn held_false_groups_vips_by_reason() {
    let dead = NoHolder::NoneAlive { pool: "p".into(), eligible: vec!["n1".into(), "n2".into()] };
    let none = NoHolder::NoEligibleNode { pool: "p".into(), nodes: 3, left_out: vec![("cp".into(), "tainted".into())] };
    let unheld: BTreeMap<IpAddr, &NoHolder> =
        [("198.18.1.1".parse().unwrap(), &dead), ("198.18.1.2".parse().unwrap(), &none), ("198.18.1.3".parse().unwrap(), &dead)].into();
    let c = held_condition(&unheld, Some(2), &[], &Time(Timestamp::from_second(1_700_000_000).unwrap()));
    assert_eq!((c.type_.as_str(), c.status.as_str(), c.reason.as_str()), (HELD, "False", "NoHolder"));
    assert_eq!(
        c.message,
        r#"3 VIP(s) in use held by no node, not answered: 198.18.1.2: no node may hold VipPool "p"'s addresses: none of the 3 node(s) in use matches its nodeSelector and tolerations; left out: cp (tainted); 198.18.1.1, 198.18.1.3: none of VipPool "p"'s eligible nodes (n1, n2) is alive: no heartbeats heard"#
    );
    assert_eq!(held_condition(&BTreeMap::new(), Some(2), &[], &c.last_transition_time).reason, "AllHeld");
}
