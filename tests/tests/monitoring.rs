//! deploy/monitoring/: the alert rules pass their unit tests (`promtool test
//! rules`, which fails in CI when promtool is missing and skips elsewhere); every
//! query of the rules, of their tests and of the Grafana dashboard names metrics
//! the agent exports (its registry's own list, as docs/reference/metrics.md shows
//! it) with labels and reasons they have; every alert is tested and documented;
//! the PodMonitor, PrometheusRule and dashboard ConfigMap fit the DaemonSet and the
//! files they come from. And, as root, a real Prometheus scraping the HA lab's
//! agents through a failover: the rules fire and resolve as they should.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use promql_parser::{
    label::{MatchOp, Matcher},
    parser::{self, Expr},
    util::{walk_expr, ExprVisitor},
};
use serde_json::Value;
use vip_agent::reference::{metrics as reference, MetricDoc};
use vip_tests::{
    agent::wait_for,
    docs::repo_root,
    halab::{HaLab, HaSpec, Naming},
    kubeapi, monitoring,
};

fn dir() -> PathBuf {
    repo_root().join("deploy/monitoring")
}

fn yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rules() -> Value {
    yaml(&dir().join("vip-alerts.yaml"))
}

/// Every rule of the rule file.
fn each_rule(rules: &Value) -> Vec<&Value> {
    rules["groups"].as_array().expect("groups").iter().flat_map(|g| g["rules"].as_array().expect("rules").iter()).collect()
}

#[test]
fn the_alert_rules_pass_their_unit_tests() {
    if !monitoring::prometheus_installed("promtool") {
        return;
    }
    for args in [["check", "rules", "vip-alerts.yaml"], ["test", "rules", "vip-alerts.test.yaml"]] {
        let out = Command::new("promtool").args(args).current_dir(dir()).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "promtool {}:\n{text}", args.join(" "));
        assert!(text.contains("SUCCESS"), "promtool {}:\n{text}", args.join(" "));
    }
}

/// Labels every scraped series has besides its own (Prometheus' and the PodMonitor's).
const TARGET_LABELS: [&str; 6] = ["instance", "job", "namespace", "pod", "container", "endpoint"];

/// Each series name the agent exports (histograms by their three series), with its labels.
fn exported() -> BTreeMap<String, MetricDoc> {
    let mut out = BTreeMap::new();
    for d in reference() {
        if d.kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                let mut h = d.clone();
                if suffix == "_bucket" {
                    h.labels.push("le".into());
                }
                out.insert(format!("{}{suffix}", d.name), h);
            }
        } else {
            out.insert(d.name.clone(), d);
        }
    }
    // Prometheus' own series of each target: 1 when the last scrape succeeded.
    out.insert("up".into(), MetricDoc { name: "up".into(), kind: "gauge".into(), labels: Vec::new(), help: String::new(), only: None });
    out
}

/// The selectors of a PromQL expression: (metric name, matchers).
struct Selectors(Vec<(Option<String>, Vec<Matcher>)>);

impl ExprVisitor for Selectors {
    type Error = ();
    fn pre_visit(&mut self, e: &Expr) -> Result<bool, ()> {
        let vs = match e {
            Expr::VectorSelector(vs) => vs,
            Expr::MatrixSelector(ms) => &ms.vs,
            _ => return Ok(true),
        };
        // The name is also a matcher (`__name__`) in the parsed tree; keep the others.
        let matchers = vs.matchers.matchers.iter().chain(vs.matchers.or_matchers.iter().flatten()).filter(|m| m.name != "__name__").cloned().collect();
        self.0.push((vs.name.clone(), matchers));
        Ok(true)
    }
}

/// What is wrong with the selectors of `expr` (`what` says where it is from).
fn check_query(what: &str, expr: &str, known: &BTreeMap<String, MetricDoc>, reasons: &[&str], seen: &mut BTreeSet<String>) -> Vec<String> {
    let e = match parser::parse(expr) {
        Ok(e) => e,
        Err(err) => return vec![format!("{what}: {expr:?} does not parse: {err}")],
    };
    let mut s = Selectors(Vec::new());
    walk_expr(&mut s, &e).expect("the visitor never fails");
    let mut bad = Vec::new();
    for (name, matchers) in s.0 {
        let Some(name) = name else {
            bad.push(format!("{what}: a selector without a metric name in {expr:?}"));
            continue;
        };
        let Some(doc) = known.get(&name) else {
            bad.push(format!("{what}: {name} is no metric of the agent (docs/reference/metrics.md)"));
            continue;
        };
        seen.insert(name.clone());
        for m in matchers {
            if !doc.labels.contains(&m.name) && !TARGET_LABELS.contains(&m.name.as_str()) {
                bad.push(format!("{what}: {name} has no label {:?} (its labels: {:?})", m.name, doc.labels));
            }
            // A reason that does not exist would match nothing, silently.
            if m.name == "reason" && name.starts_with("vip_xdp_") {
                let ok = match &m.op {
                    MatchOp::Equal | MatchOp::NotEqual => reasons.contains(&m.value.as_str()),
                    // Anchored, as PromQL anchors it.
                    MatchOp::Re(re) | MatchOp::NotRe(re) => reasons.iter().any(|r| re.is_match(r)),
                };
                if !ok {
                    bad.push(format!("{what}: reason {:?} of {name} matches no data-path reason (docs/reference/reasons.md)", m.value));
                }
            }
        }
    }
    bad
}

/// The dashboard's PromQL with Grafana's variables replaced by what they stand for.
fn dashboard_queries(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    fn panels<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
        for p in v["panels"].as_array().into_iter().flatten() {
            out.push(p);
            panels(p, out);
        }
    }
    let mut all = Vec::new();
    panels(d, &mut all);
    for p in all {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_else(|| panic!("panel {:?}: a target without expr", p["title"]));
            out.push((format!("dashboard panel {:?}", p["title"].as_str().unwrap_or("")), expr.replace("$__rate_interval", "5m").replace("$instance", ".*")));
        }
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten().filter(|v| v["type"] == "query") {
        // label_values(METRIC, LABEL): the metric as a selector of its own.
        let q = v["query"]["query"].as_str().or(v["query"].as_str()).expect("a variable's query");
        let inner = q.strip_prefix("label_values(").and_then(|r| r.strip_suffix(')')).unwrap_or_else(|| panic!("variable {}: {q}", v["name"]));
        let (metric, label) = inner.rsplit_once(',').expect("label_values(metric, label)");
        out.push((format!("dashboard variable {}", v["name"]), format!("{}{{{}=~\".*\"}}", metric.trim(), label.trim())));
    }
    out
}

#[test]
fn every_query_names_metrics_and_labels_the_agent_exports() {
    let known = exported();
    let reasons: Vec<&str> = vip_common::Reason::ALL.iter().map(|r| r.name()).collect();
    let mut queries: Vec<(String, String)> = Vec::new();
    for r in each_rule(&rules()) {
        queries.push((format!("alert {}", r["alert"].as_str().unwrap_or("?")), r["expr"].as_str().expect("expr").to_owned()));
    }
    // The unit tests' input series must be real series too, or they test nothing.
    let tests = yaml(&dir().join("vip-alerts.test.yaml"));
    for t in tests["tests"].as_array().expect("tests") {
        for s in t["input_series"].as_array().expect("input_series") {
            queries.push((format!("test {:?}", t["name"].as_str().unwrap_or("")), s["series"].as_str().expect("series").to_owned()));
        }
    }
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(dir().join("vip-dashboard.json")).unwrap()).expect("the dashboard is JSON");
    let from_dashboard = dashboard_queries(&dashboard);
    assert!(from_dashboard.len() >= 20, "{from_dashboard:?}");
    queries.extend(from_dashboard);
    let mut seen = BTreeSet::new();
    let bad: Vec<String> = queries.iter().flat_map(|(what, q)| check_query(what, q, &known, &reasons, &mut seen)).collect();
    assert!(bad.is_empty(), "{} problem(s):\n{}", bad.len(), bad.join("\n"));
    // The check itself: a misspelt metric, an unknown label and an unknown reason are caught.
    let caught = check_query(
        "self-check",
        r#"rate(vip_xdp_packet_total[5m]) + on() vip_owner{owner="x"} + vip_xdp_packets_total{reason="drop_nope"}"#,
        &known,
        &reasons,
        &mut BTreeSet::new(),
    );
    assert_eq!(caught.len(), 3, "{caught:?}");
    eprintln!("{} queries name {} metrics of the agent's {}", queries.len(), seen.len(), known.len());
}

#[test]
fn every_alert_is_unit_tested_and_documented() {
    let tests = yaml(&dir().join("vip-alerts.test.yaml"));
    let fired: BTreeSet<&str> = tests["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .filter(|a| a["exp_alerts"].as_array().is_some_and(|e| !e.is_empty()))
        .filter_map(|a| a["alertname"].as_str())
        .collect();
    let quiet: BTreeSet<&str> = tests["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .filter(|a| a["exp_alerts"].as_array().is_none_or(|e| e.is_empty()))
        .filter_map(|a| a["alertname"].as_str())
        .collect();
    let doc = std::fs::read_to_string(repo_root().join("docs/operations/observability.md")).unwrap();
    let headings: BTreeSet<&str> = doc.lines().filter(|l| l.starts_with('#')).map(|l| l.trim_start_matches('#').trim()).collect();
    let rules = rules();
    let mut names = BTreeSet::new();
    for r in each_rule(&rules) {
        let name = r["alert"].as_str().expect("every rule is an alert");
        assert!(names.insert(name), "{name} twice");
        assert!(fired.contains(name), "{name}: no unit test in vip-alerts.test.yaml expects it to fire");
        assert!(quiet.contains(name), "{name}: no unit test in vip-alerts.test.yaml expects it quiet (before `for`, or resolved)");
        assert!(headings.contains(name), "{name}: no heading `{name}` in docs/operations/observability.md");
        for k in ["summary", "description"] {
            assert!(r["annotations"][k].as_str().is_some_and(|s| !s.is_empty()), "{name}: no {k}");
        }
        assert!(["critical", "warning", "info"].contains(&r["labels"]["severity"].as_str().unwrap_or("")), "{name}: severity {:?}", r["labels"]["severity"]);
    }
}

#[test]
fn the_monitoring_manifests_fit_the_agent_and_their_sources() {
    let docs = kubeapi::kustomize(&dir()).unwrap();
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap_or_else(|| panic!("no {k} in kubectl kustomize deploy/monitoring"));
    let agent = kubeapi::kustomize(&repo_root().join("deploy")).unwrap();
    let ds = agent.iter().find(|d| d["kind"] == "DaemonSet").expect("the agent's DaemonSet");
    let pod = &ds["spec"]["template"];
    let container = &pod["spec"]["containers"][0];

    // The PodMonitor selects the agents' pods and scrapes the port they serve /metrics on.
    let pm = kind("PodMonitor");
    assert_eq!(pm["metadata"]["namespace"], ds["metadata"]["namespace"]);
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels") {
        assert_eq!(&pod["metadata"]["labels"][k], v, "the PodMonitor selects {k}={v}, the agents' pods are labelled {:?}", pod["metadata"]["labels"]);
    }
    let ep = &pm["spec"]["podMetricsEndpoints"][0];
    assert_eq!(ep["path"], "/metrics");
    let port = container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == ep["port"])
        .unwrap_or_else(|| panic!("no container port named {}", ep["port"]));
    let args: Vec<&str> = container["args"].as_array().expect("args").iter().filter_map(Value::as_str).collect();
    let addr = args.iter().position(|a| *a == "--metrics-addr").map(|i| args[i + 1]).expect("the DaemonSet sets --metrics-addr");
    assert_eq!(addr.rsplit_once(':').map(|(_, p)| p), Some(port["containerPort"].to_string().as_str()), "--metrics-addr {addr} against the port {port}");

    // The PrometheusRule is the rule file, and what `cargo xtask docs` makes of it.
    let pr = kind("PrometheusRule");
    assert_eq!(pr["spec"], rules(), "the PrometheusRule's spec differs from vip-alerts.yaml: run `cargo xtask docs`");
    let text = std::fs::read_to_string(repo_root().join(monitoring::PROMETHEUS_RULE)).unwrap();
    assert_eq!(text, monitoring::prometheus_rule(&std::fs::read_to_string(repo_root().join(monitoring::RULES)).unwrap()).unwrap(), "run `cargo xtask docs`");

    // The dashboard's ConfigMap carries the dashboard file, for Grafana's sidecar.
    let cm = kind("ConfigMap");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["data"]["vip-dashboard.json"].as_str(), Some(std::fs::read_to_string(dir().join("vip-dashboard.json")).unwrap().as_str()));
}

/// Alerts that must never fire while VIPs move as designed.
const NEVER_IN_A_FAILOVER: [&str; 4] = ["VipUnanswered", "VipAnsweredTwice", "VipPoolUnowned", "VipOwnerDisagreement"];

#[test]
fn a_real_prometheus_sees_a_failover_fire_and_resolve_the_alerts() {
    if !vip_tests::netns::privileged() || !monitoring::prometheus_installed("prometheus") {
        return;
    }
    vip_tests::agent::agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let spec = HaSpec { vips: 6, metrics_on_segment: true, ..Default::default() };
    let mut lab = HaLab::start(spec, Naming::Unique, Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap();
    let all = [0, 1, 2];
    let owners = lab.wait_converged(&all, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let names: Vec<String> = lab.nodes.iter().map(|n| n.name.clone()).collect();
    let targets: Vec<(String, String)> = lab.nodes.iter().map(|n| (n.name.clone(), format!("{}:9472", n.addr))).collect();
    let prom = monitoring::Prometheus::start(&lab.client, &targets).unwrap();
    let up = wait_for(Duration::from_secs(30), || prom.targets().ok().filter(|t| t.len() == 3 && t.values().all(|h| h == "up")));
    assert!(up.is_some(), "targets {:?}\n{}", prom.targets(), prom.log());

    // Steady state: a few evaluations see every rule quiet. A heartbeat gap past
    // half of the lab's short deadAfter may be pending on a busy machine (it fires
    // after 5 minutes only).
    std::thread::sleep(Duration::from_secs(5));
    let now = prom.alerts().unwrap();
    assert!(now.iter().all(|a| a.name == "VipHeartbeatGapHigh" && a.state == "pending"), "alerts in steady state: {now:#?}");

    // node-1's agent dies: its peers stop hearing it, take its VIPs, and after a
    // minute each says so; no VIP goes unanswered or answered twice meanwhile.
    let victim = &names[0];
    assert!(owners.values().any(|o| o == victim), "{victim} owns no VIP: {owners:?}");
    lab.kill_agent(0);
    let mut seen = std::collections::BTreeSet::new();
    let want: std::collections::BTreeSet<String> = names[1..].iter().cloned().collect();
    let fired = wait_for(Duration::from_secs(120), || {
        let alerts = prom.alerts().ok()?;
        for a in &alerts {
            seen.insert((a.name.clone(), a.state.clone()));
            assert!(!(NEVER_IN_A_FAILOVER.contains(&a.name.as_str()) && a.state == "firing"), "during the failover: {a:?}\n{alerts:#?}");
        }
        let down: std::collections::BTreeSet<String> = alerts
            .iter()
            .filter(|a| a.name == "VipPeerDown" && a.state == "firing" && a.labels.get("peer") == Some(victim))
            .filter_map(|a| a.labels.get("instance").cloned())
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        (down == want).then_some(())
    });
    assert!(fired.is_some(), "VipPeerDown for {victim} did not fire on {want:?}; seen {seen:?}\n{}", prom.log());
    let moved = lab.wait_converged(&[1, 2], Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(moved.values().all(|o| o != victim), "{moved:?}");

    // Back: everything resolves within a minute (the ARP conflict a handback may
    // cause is no alert: VIPs changed owner then). The agents' views differ for a
    // scrape or two meanwhile (who holds what, scraped a second apart): pending,
    // never firing.
    lab.start_agent(0).unwrap();
    lab.wait_converged(&all, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let tolerated = |a: &monitoring::Alert| a.name == "VipHeartbeatGapHigh" && a.state == "pending";
    let mut back = std::collections::BTreeSet::new();
    let resolved = wait_for(Duration::from_secs(60), || {
        let alerts = prom.alerts().ok()?;
        for a in &alerts {
            back.insert((a.name.clone(), a.state.clone()));
            assert!(!(NEVER_IN_A_FAILOVER.contains(&a.name.as_str()) && a.state == "firing"), "after the agent came back: {a:?}\n{alerts:#?}");
        }
        std::thread::sleep(Duration::from_millis(500));
        alerts.iter().all(tolerated).then_some(alerts)
    });
    let after = resolved.unwrap_or_else(|| panic!("alerts did not resolve within a minute: {:#?}", prom.alerts()));
    eprintln!("alerts seen during the failover: {seen:?}; after it: {back:?}; left: {after:?}");
}
