use super::*;
use crate::status::{NodeStatus, ServiceStatus};

fn status(updated_unix_ms: u64) -> Status {
    Status {
        node: "n1".into(),
        updated_unix_ms,
        nodes: vec![
            NodeStatus { node: "n1".into(), addr: "198.18.0.11".parse().unwrap(), mac: None, version: None },
            NodeStatus { node: "n2".into(), addr: "198.18.0.12".parse().unwrap(), mac: None, version: None },
        ],
        services: vec![ServiceStatus {
            name: "shop/web".into(),
            vip: "198.18.1.10".parse().unwrap(),
            port: 80,
            protocol: "tcp".into(),
            backends: vec!["n1".into(), "n2".into()],
            draining: vec![],
            check: None,
            failing_open: false,
        }],
        ..Default::default()
    }
}

fn service(port: u16, ring: Vec<RingMember>) -> ServiceRow {
    ServiceRow { name: None, vip: "198.18.1.10".parse().unwrap(), port, proto: "tcp", id: 7, table_size: 251, packets: 5, bytes: 300, ring }
}

fn member(id: u32, node: &str, addr: &str, slots: u32) -> RingMember {
    RingMember { backend_id: id, node: Some(node.into()), addr: Some(addr.parse().unwrap()), slots, share_pct: 100.0 * f64::from(slots) / 251.0 }
}

fn report(info: StatusInfo, st: Option<Status>, services: Vec<ServiceRow>) -> Report {
    let mut r = Report { held: vec![], services, backends: vec![], reasons: vec![], flows: 0, status: info, agent: None };
    r.agent = st.map(|st| agent_section(&r, st));
    r
}

fn read(text: Option<&str>, now: u64) -> (StatusInfo, Option<Status>) {
    let dir = std::env::temp_dir().join(format!("vip-inspect-{}-{now}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("status.json");
    let _ = std::fs::remove_file(&path);
    if let Some(t) = text {
        std::fs::write(&path, t).unwrap();
    }
    let r = read_status(&path, now);
    std::fs::remove_dir_all(&dir).unwrap();
    r
}

#[test]
fn services_show_names_and_nodes_not_ids() {
    let (info, st) = read(Some(&serde_json::to_string(&status(1_000)).unwrap()), 4_000);
    let mut web = service(80, vec![member(3, "n1", "198.18.0.11", 126), member(9, "n2", "198.18.0.12", 125)]);
    web.name = Some("shop/web".into());
    let r = report(info, st, vec![web, service(0, vec![])]);
    let text = render(&r, false);
    let row = text.lines().find(|l| l.contains("198.18.1.10:80/tcp")).unwrap();
    assert!(row.contains("shop/web") && row.contains("n1 50.2%, n2 49.8%"), "{text}");
    assert!(!row.contains(" 7 ") && !row.contains("3:126"), "no internal ids: {row}");
    assert!(!text.contains("fragments"), "the fragment alias is internal: {text}");
    assert!(text.starts_with("AGENT n1 (config generation 0): status written 3 s ago (1970-01-01T00:00:01.000Z)\n"), "{text}");
    let verbose = render(&r, true);
    assert!(verbose.contains("198.18.1.10:*fragments/tcp") && verbose.contains("n1 (id 3) 126/251"), "{verbose}");
}

#[test]
fn a_service_without_backends_says_so() {
    let (info, _) = read(None, 0);
    let text = render(&report(info, None, vec![service(80, vec![])]), false);
    let row = text.lines().find(|l| l.contains("198.18.1.10:80/tcp")).unwrap();
    assert!(row.contains("none: new connections are dropped (drop_no_backend)"), "{row}");
    assert!(!text.contains("4294967295"), "{text}");
}

#[test]
fn a_missing_unreadable_or_old_status_is_reported() {
    let (info, st) = read(None, 0);
    assert_eq!((info.state, st.is_none()), ("missing", true));
    assert!(render(&report(info, None, vec![]), false).starts_with("AGENT: no status file at "));

    let (info, st) = read(Some("{\"node\": 3"), 0);
    assert_eq!((info.state, st.is_none()), ("unreadable", true));
    let text = render(&report(info, None, vec![]), false);
    assert!(text.contains("could not be read: not a status: "), "{text}");

    let (info, st) = read(Some(&serde_json::to_string(&status(1_000)).unwrap()), 1_000 + 5 * 60_000 + 2_000);
    assert!(info.stale());
    let text = render(&report(info, st, vec![]), false);
    assert!(text.contains("status written 5 min 2 s ago") && text.contains("STALE: not rewritten for 5 min 2 s"), "{text}");

    // A status from an agent before timestamps: read, age unknown.
    let (info, st) = read(Some(&serde_json::to_string(&status(0)).unwrap().replace("\"updated_unix_ms\":0,", "")), 9_000);
    assert!(st.is_some() && !info.stale());
    assert!(render(&report(info, st, vec![]), false).contains("status age unknown"));
}

/// A 36-character IPv6 VIP (longer than any column's old width) and a node's.
const VIP6: &str = "2001:2:ffff:ffff:ffff:ffff:ffff:ff10";
const NODE6: &str = "2001:2::ffff:11";

/// Where each of `cells` begins in `line` (found in order, each after the last).
fn starts(line: &str, cells: &[&str]) -> Vec<usize> {
    let mut from = 0;
    cells
        .iter()
        .map(|c| {
            let at = from + line[from..].find(c).unwrap_or_else(|| panic!("{c:?} not in {line:?}"));
            from = at + c.len();
            at
        })
        .collect()
}

/// The lines of the table titled `title` in `text`: its header, then its rows.
fn table<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    text.lines().skip_while(|l| !l.starts_with(title)).skip(1).take_while(|l| !l.is_empty()).collect()
}

/// Asserts that each row's cells (in order) begin where the header's columns
/// do; `right`: columns right-aligned, whose ends line up instead.
fn assert_aligned(text: &str, title: &str, head: &[&str], rows: &[Vec<String>], right: &[usize]) {
    let t = table(text, title);
    assert_eq!(t.len(), rows.len() + 1, "{title}:\n{text}");
    let ends = |line: &str, cells: &[&str]| -> Vec<usize> {
        starts(line, cells).into_iter().zip(cells).enumerate().map(|(i, (at, c))| if right.contains(&i) { at + c.len() } else { at }).collect()
    };
    let want = ends(t[0], head);
    for (line, cells) in t[1..].iter().zip(rows) {
        let cells: Vec<&str> = cells.iter().map(String::as_str).collect();
        assert_eq!(ends(line, &cells), want, "{title}: {line:?} out of line with {:?}\n{text}", t[0]);
    }
}

fn strings(cells: &[&str]) -> Vec<String> {
    cells.iter().map(|c| (*c).to_owned()).collect()
}

/// A report with IPv4 and IPv6 rows in every table.
fn dual_stack_report() -> Report {
    let (info, _) = read(None, 1);
    let held = |network: &str, vip: &str, announce| HeldRow {
        ifindex: 2,
        network: network.into(),
        vip: vip.parse().unwrap(),
        expires_in_ms: 900,
        announce,
        taken_from: None,
    };
    let backend = |id, node: &str, addr: &str| BackendRow {
        id,
        node: Some(node.into()),
        addr: addr.parse().unwrap(),
        mac: "02:00:00:00:00:01".into(),
        local: false,
        packets: 12,
        bytes: 3456,
    };
    let mut web = service(80, vec![member(3, "n1", "198.18.0.11", 251)]);
    web.name = Some("shop/web".into());
    let mut web6 = ServiceRow { vip: VIP6.parse().unwrap(), ..service(443, vec![member(4, "n2", NODE6, 251)]) };
    web6.name = Some("shop/web6".into());
    let frag6 = ServiceRow { vip: VIP6.parse().unwrap(), ..service(0, vec![member(4, "n2", NODE6, 251)]) };
    let health = |service: &str, node: &str, addr: &str, healthy, pct| HealthRow {
        service: service.into(),
        node: node.into(),
        addr: addr.parse().unwrap(),
        healthy,
        ring_share_pct: pct,
        detail: "connect refused".into(),
    };
    Report {
        held: vec![held("eth0", "198.18.1.10", "arp"), held("eth0 VLAN 30", VIP6, "ndp")],
        services: vec![web, web6, frag6],
        backends: vec![backend(3, "n1", "198.18.0.11"), backend(4, "n2", NODE6)],
        reasons: vec![CounterRow { reason: "forwarded", packets: 7, bytes: 700 }],
        flows: 0,
        status: info,
        agent: Some(AgentSection {
            node: "n1".into(),
            config_generation: 1,
            config_error: None,
            owners: BTreeMap::from([("198.18.1.10".parse().unwrap(), "n1".into()), (VIP6.parse().unwrap(), "n2".into())]),
            backends: vec![health("shop/web", "n1", "198.18.0.11", true, 100.0), health("shop/web6", "n2", NODE6, false, 0.0)],
            unprogrammed: vec![crate::status::UnprogrammedStatus {
                name: "shop/big6".into(),
                vip: VIP6.parse().unwrap(),
                port: 8443,
                protocol: "tcp".into(),
                error: "lb4_ring is full".into(),
            }],
            host_problems: vec![],
            settings_mismatch: vec!["n2: deadAfter 1s there, 300ms here".into()],
            bgp: None,
            usage: Default::default(),
        }),
    }
}

#[test]
fn ipv6_addresses_keep_every_table_in_line() {
    let r = dual_stack_report();
    for verbose in [false, true] {
        let text = render(&r, verbose);
        let id = |id: &str, cells: &[&str]| -> Vec<String> {
            if verbose {
                strings(&[&[id], cells].concat())
            } else {
                strings(cells)
            }
        };
        let head = |cells: &[&'static str]| -> Vec<&'static str> {
            if verbose {
                [&["ID"], cells].concat()
            } else {
                cells.to_vec()
            }
        };
        assert_aligned(
            &text,
            "HELD VIPS",
            &["NETWORK", "VIP", "ANNOUNCE", "EXPIRES", "TAKEN FROM"],
            &[strings(&["eth0", "198.18.1.10", "arp", "in 900 ms", "-"]), strings(&["eth0 VLAN 30", VIP6, "ndp", "in 900 ms", "-"])],
            &[],
        );
        let v6 = format!("[{VIP6}]:443/tcp");
        let mut services = vec![id("7", &["shop/web", "198.18.1.10:80/tcp", "5", "300", "n1"]), id("7", &["shop/web6", &v6, "5", "300", "n2"])];
        if verbose {
            services.push(id("7", &["?", &format!("[{VIP6}]:*fragments/tcp"), "5", "300", "n2"]));
        }
        assert_aligned(&text, "SERVICES", &head(&["SERVICE", "VIP:PORT/PROTO", "PACKETS", "BYTES", "BACKENDS"]), &services, &[]);
        assert_aligned(
            &text,
            "BACKENDS",
            &head(&["NODE", "ADDRESS", "MAC", "LOCAL", "PACKETS", "BYTES"]),
            &[id("3", &["n1", "198.18.0.11", "02:00:00:00:00:01", "false", "12", "3456"]), id("4", &["n2", NODE6, "02:00:00:00:00:01", "false", "12", "3456"])],
            &[],
        );
        assert_aligned(&text, "OWNERS", &["VIP", "OWNER"], &[strings(&["198.18.1.10", "n1"]), strings(&[VIP6, "n2"])], &[]);
        assert_aligned(
            &text,
            "HEALTH",
            &["SERVICE", "BACKEND", "ADDRESS", "HEALTH", "RING", "DETAIL"],
            &[
                strings(&["shop/web", "n1", "198.18.0.11", "up", "100.00%", "connect refused"]),
                strings(&["shop/web6", "n2", NODE6, "DOWN", "0.00%", "connect refused"]),
            ],
            &[4],
        );
        assert_aligned(
            &text,
            "NOT PROGRAMMED",
            &["SERVICE", "VIP:PORT/PROTO", "ERROR"],
            &[strings(&["shop/big6", &format!("[{VIP6}]:8443/tcp"), "lb4_ring is full"])],
            &[],
        );
        assert!(
            text.contains("\nCLUSTER SETTINGS DIFFER (every agent must be set alike)\n  n2: deadAfter 1s there, 300ms here\n"),
            "the peers whose settings differ:\n{text}"
        );
        // No address:port without brackets, and no trailing spaces.
        assert!(!text.contains(&format!("{VIP6}:")), "an IPv6 VIP:PORT without brackets:\n{text}");
        assert!(text.lines().all(|l| l == l.trim_end()), "trailing spaces:\n{text}");
    }
}

#[test]
fn ipv4_tables_keep_their_widths() {
    // Short IPv4 rows: the columns as wide as before (16 for an address).
    let mut r = dual_stack_report();
    r.held.truncate(1);
    let text = render(&r, false);
    assert!(text.contains("\n  NETWORK          VIP              ANNOUNCE  EXPIRES              TAKEN FROM\n  eth0             198.18.1.10      arp       in 900 ms            -\n"), "{text}");
    assert!(text.contains("\n  forwarded                             7 pkts          700 bytes\n"), "{text}");
}

#[test]
fn bgp_sessions_are_listed_with_their_state_and_last_reset() {
    let mut st = status(1);
    st.bgp = Some(crate::status::BgpStatus {
        routes: 2,
        sessions: vec![
            crate::status::BgpSessionStatus {
                peer: "198.18.0.1".parse().unwrap(),
                state: "Established".into(),
                prefixes_sent: 2,
                prefixes_received: 0,
                last_reset: None,
            },
            crate::status::BgpSessionStatus {
                peer: "2001:2::1".parse().unwrap(),
                state: "Active".into(),
                prefixes_sent: 0,
                prefixes_received: 0,
                last_reset: Some("Waiting for peer OPEN".into()),
            },
        ],
        reload_error: Some("frr-reload.py failed".into()),
    });
    let (info, _) = read(Some(&serde_json::to_string(&st).unwrap()), 2_000);
    let text = render(&report(info, Some(st), vec![]), false);
    assert!(
        text.contains("\nBGP (2 routes in FRR's configuration)\n  FRR refused the last configuration (retried every 5 s): frr-reload.py failed\n"),
        "{text}"
    );
    assert!(text.contains("\n  198.18.0.1                 Established       2         0   -\n"), "{text}");
    assert!(text.contains("\n  2001:2::1                  Active            0         0   Waiting for peer OPEN\n"), "{text}");
    assert!(text.lines().all(|l| l == l.trim_end()), "trailing spaces:\n{text}");
    // Without BGP, no section.
    let (info, plain) = read(Some(&serde_json::to_string(&status(1)).unwrap()), 2_001);
    assert!(!render(&report(info, plain, vec![]), false).contains("BGP"));
}
