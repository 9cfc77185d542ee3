//! The agent's Kubernetes client after an API server outage (stand-in stopped, its
//! listener closed, then served again on the same address with its watch history
//! compacted, as a restarted server's fresh watch cache): every watch is back and a
//! Service created after the restart has its address within 5 s (kube-runtime's
//! default backoff, up to 30 s plus one more for the 410 that follows, took ~50 s).
//! Also: the reachability metric follows the outage, and requests name the agent in
//! their User-Agent.
use std::time::Duration;

use vip_tests::kubefix::outage_then_new_service;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_service_is_addressed_within_5s_of_the_api_server_coming_back() {
    // An outage longer than the lease: the leader stops leading, every watch fails.
    let outage = Duration::from_secs(16);
    let o = outage_then_new_service(outage).await.unwrap();
    println!(
        "resync: new Service addressed {:.2} s after the API server came back ({outage:?} outage, {} errors counted)",
        o.addressed_after.as_secs_f64(),
        o.errors
    );
    assert!(o.lost_leadership, "the leader still leads after a {outage:?} outage");
    assert!(o.unreachable, "vip_kube_api_reachable was not 0 during the outage");
    assert!(o.errors > 0, "no error counted during the outage");
    assert!(o.addressed_after <= Duration::from_secs(5), "new Service addressed {:?} after the server came back (want ≤ 5 s)", o.addressed_after);
    assert!(o.after.is_some() && o.after != o.before, "before {:?}, after {:?}", o.before, o.after);
    println!("leading again and reachable {:.2} s after the server came back", o.leading_again_after.as_secs_f64());
    assert_eq!(o.user_agents, [format!("vip-agent/{}", env!("CARGO_PKG_VERSION"))].into(), "User-Agents seen: {:?}", o.user_agents);
}
