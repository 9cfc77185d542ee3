//! Which real Kubernetes components the tests can run against, decided when the
//! tests are built: `real_apiserver` where `KUBEBUILDER_ASSETS` names kube-apiserver
//! and etcd, `real_cluster` where `VIP_KUBE_NODE_ASSETS` names the node binaries
//! too. Tests that need them are `#[ignore]`d otherwise, with the reason, so libtest
//! reports them as not run (never as passed). Setting either variable rebuilds.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(real_apiserver)");
    println!("cargo::rustc-check-cfg=cfg(real_cluster)");
    println!("cargo::rerun-if-env-changed=KUBEBUILDER_ASSETS");
    println!("cargo::rerun-if-env-changed=VIP_KUBE_NODE_ASSETS");
    let set = |v: &str| std::env::var_os(v).is_some_and(|v| !v.is_empty());
    if set("KUBEBUILDER_ASSETS") {
        println!("cargo::rustc-cfg=real_apiserver");
        if set("VIP_KUBE_NODE_ASSETS") {
            println!("cargo::rustc-cfg=real_cluster");
        }
    }
}
