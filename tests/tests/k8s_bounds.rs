//! The API server refuses at apply time what the agent would refuse: every bound of
//! the VipPool spec's schema (read from it, `vip_agent::k8s::crd::spec_bounds`, and
//! defined by the constants the agent's `validate()` checks against, with which
//! `crd.rs`'s unit tests hold it equal) is applied just outside its limits, each a
//! 422 Invalid with one cause naming the field, worded as kube-apiserver words it
//! (go-openapi's `minIncFail`/`maxIncFail`, ...); its limits themselves are taken.
//! What the schema cannot say (a table size that is not a prime) is taken by the
//! server and refused by the agent: the pool turns `Ready=False` naming the field.
use http::Method;
use serde_json::{json, Value};
use vip_agent::k8s::crd::{spec_bounds, BoundOf, SchemaBound};
use vip_tests::{
    kubeapi::{raw, Backend},
    kubefix::{eventually, pool_condition, run_controller},
};

vip_tests::both_api_servers!(vip_pool_bounds_are_refused_at_apply_time);
vip_tests::both_api_servers!(a_table_size_that_is_not_a_prime_is_the_agents_to_refuse);

const POOLS: &str = "/apis/vip.dev/v1alpha1/vippools";

fn pool(name: &str, spec: Value) -> Value {
    json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": name }, "spec": spec })
}

/// The one cause (reason, message) the real server gives for `n` just outside `b`,
/// `below` or above it.
fn refusal(b: &SchemaBound, n: i64, below: bool) -> (&'static str, String) {
    let f = b.field();
    match (b.of, below) {
        (BoundOf::Value, true) => ("FieldValueInvalid", format!("Invalid value: {n}: {f} in body should be greater than or equal to {}", n + 1)),
        (BoundOf::Value, false) => ("FieldValueInvalid", format!("Invalid value: {n}: {f} in body should be less than or equal to {}", n - 1)),
        (BoundOf::Length, true) => {
            ("FieldValueInvalid", format!("Invalid value: {:?}: {f} in body should be at least {} chars long", "a".repeat(n as usize), n + 1))
        }
        (BoundOf::Length, false) => ("FieldValueTooLong", format!("Too long: may not be more than {} bytes", n - 1)),
        (BoundOf::Items, true) => ("FieldValueInvalid", format!("Invalid value: {n}: {f} in body should have at least {} items", n + 1)),
        (BoundOf::Items, false) => ("FieldValueTooMany", format!("Too many: {n}: must have at most {} items", n - 1)),
    }
}

async fn vip_pool_bounds_are_refused_at_apply_time(api: Backend) {
    let c = api.client().await;
    let bounds = spec_bounds();
    for field in ["spec.gratuitousArp.count", "spec.tableSize", "spec.healthCheck.rise", "spec.healthCheck.fall", "spec.vlan"] {
        assert!(bounds.iter().any(|b| b.path == field), "{field} is bounded in the schema: {bounds:?}");
    }
    for b in &bounds {
        let outside = [b.min.filter(|m| *m > 0).map(|m| (m - 1, true)), b.max.map(|m| (m + 1, false))];
        for (n, below) in outside.into_iter().flatten() {
            let body = pool("bounds", b.spec_with(n));
            let r = raw(&c, Method::POST, POOLS, "application/json", Some(&body)).await.unwrap();
            let (reason, message) = refusal(b, n, below);
            let field = b.field();
            let causes: Vec<(String, String, String)> = r.body["details"]["causes"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    (
                        c["reason"].as_str().unwrap_or("").to_owned(),
                        c["field"].as_str().unwrap_or("").to_owned(),
                        c["message"].as_str().unwrap_or("").to_owned(),
                    )
                })
                .collect();
            assert_eq!(
                (r.status, r.body["reason"].as_str(), causes),
                (422, Some("Invalid"), vec![(reason.to_owned(), field.clone(), message.clone())]),
                "{} = {n}: {}",
                b.path,
                r.body
            );
            assert_eq!(r.body["message"].as_str(), Some(format!("VipPool.vip.dev \"bounds\" is invalid: {field}: {message}").as_str()), "{}", r.body);
        }
        for n in [b.min, b.max].into_iter().flatten() {
            let body = pool("bounds", b.spec_with(n));
            let r = raw(&c, Method::POST, POOLS, "application/json", Some(&body)).await.unwrap();
            assert_eq!(r.status, 201, "{} = {n} is within the bounds: {}", b.path, r.body);
            raw(&c, Method::DELETE, &format!("{POOLS}/bounds"), "", None).await.unwrap().ok().unwrap();
        }
    }
}

async fn a_table_size_that_is_not_a_prime_is_the_agents_to_refuse(api: Backend) {
    let c = api.client().await;
    let r =
        raw(&c, Method::POST, POOLS, "application/json", Some(&pool("not-prime", json!({ "addresses": ["198.18.7.10"], "tableSize": 1000 })))).await.unwrap();
    assert_eq!(r.status, 201, "the schema says a range, not primes: {}", r.body);
    let (_lead, task) = run_controller(c.clone());
    eventually("Ready=False naming spec.tableSize", || {
        pool_condition(&api, "not-prime", "Ready").is_some_and(|(status, message)| status == "False" && message.contains("spec.tableSize"))
    })
    .await;
    let (_, message) = pool_condition(&api, "not-prime", "Ready").unwrap();
    assert!(message.contains("table size 1000 is not a prime between 251 and 131071"), "{message}");
    task.abort();
    raw(&c, Method::DELETE, &format!("{POOLS}/not-prime"), "", None).await.unwrap().ok().unwrap();
}
