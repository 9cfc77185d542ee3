//! The agent's image is named once under deploy/: in the kustomize Component
//! deploy/image/, which the install (deploy/) and the clean-up (deploy/cleanup/)
//! both pull in, so a user who points it at a registry moves both. Every manifest
//! carries only the placeholder the Component replaces. Fast: files only, and
//! `kubectl kustomize` where kubectl is installed.
use std::path::{Path, PathBuf};

use serde_json::Value;
use vip_tests::kubeapi::{deploy_dir, documents, kustomize, manifests};

/// The Component that names the image, relative to deploy/.
const COMPONENT: &str = "image";
/// What the manifests say instead of the image.
const PLACEHOLDER: &str = "vip.invalid/vip-agent";
/// The image's repository as `cargo xtask image` names it.
const DEFAULT_NAME: &str = "localhost/vip-agent";

/// Every file under `dir`, as paths relative to it, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_owned());
            }
        }
    }
    out.sort();
    out
}

fn is_yaml(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "yaml" || e == "yml")
}

/// The directories under deploy/ (relative) with a kustomization.yaml, and its document.
fn kustomizations(deploy: &Path) -> Vec<(PathBuf, Value)> {
    files(deploy)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "kustomization.yaml"))
        .map(|p| {
            let doc = manifests(&deploy.join(&p)).unwrap().into_iter().next().unwrap_or_else(|| panic!("{}: empty", p.display()));
            (p.parent().unwrap().to_owned(), doc)
        })
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect()).unwrap_or_default()
}

/// The `images:` entry of the Component: `(newName, newTag)`.
fn component_image(deploy: &Path) -> (String, String) {
    let doc = manifests(&deploy.join(COMPONENT).join("kustomization.yaml")).unwrap().remove(0);
    assert_eq!((doc["apiVersion"].as_str(), doc["kind"].as_str()), (Some("kustomize.config.k8s.io/v1alpha1"), Some("Component")), "{doc}");
    let images = doc["images"].as_array().expect("deploy/image/kustomization.yaml: no images:");
    assert_eq!(images.len(), 1, "{images:?}");
    let i = &images[0];
    assert_eq!(i["name"], PLACEHOLDER, "the Component must replace the manifests' placeholder: {i}");
    (i["newName"].as_str().unwrap().to_owned(), i["newTag"].as_str().unwrap().to_owned())
}

/// Every `image` of a container or init container in `docs`.
fn pod_images(docs: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for d in docs {
        let spec = &d["spec"]["template"]["spec"];
        for list in ["initContainers", "containers"] {
            for c in spec[list].as_array().into_iter().flatten() {
                out.push(c["image"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    out
}

#[test]
fn the_image_is_named_in_one_file() {
    let deploy = deploy_dir();
    let component = Path::new(COMPONENT).join("kustomization.yaml");
    let mut naming = Vec::new();
    let mut with_images = Vec::new();
    for f in files(&deploy) {
        let Ok(text) = std::fs::read_to_string(deploy.join(&f)) else { continue };
        if text.contains(DEFAULT_NAME) {
            naming.push(f.clone());
        }
        if is_yaml(&f) && documents(&text).unwrap_or_else(|e| panic!("{}: {e:#}", f.display())).iter().any(|d| d.get("images").is_some()) {
            with_images.push(f.clone());
        }
        // Every image a manifest names is the placeholder.
        if f != component {
            for line in text.lines().map(str::trim).filter(|l| l.starts_with("image:")) {
                assert_eq!(line, format!("image: {PLACEHOLDER}"), "deploy/{}: an image named outside deploy/{}", f.display(), component.display());
            }
        }
    }
    assert_eq!(naming, std::slice::from_ref(&component), "files under deploy/ that name {DEFAULT_NAME}");
    assert_eq!(with_images, std::slice::from_ref(&component), "files under deploy/ with an `images:` list");
    // Its default is the image `cargo xtask image` builds.
    assert_eq!(component_image(&deploy), (DEFAULT_NAME.to_owned(), env!("CARGO_PKG_VERSION").to_owned()));
}

#[test]
fn install_and_cleanup_pull_in_the_one_definition() {
    let deploy = deploy_dir();
    let component = deploy.join(COMPONENT).canonicalize().unwrap();
    let all = kustomizations(&deploy);
    let mut users = Vec::new();
    for (dir, doc) in &all {
        if doc["kind"] == "Component" {
            assert_eq!(dir, Path::new(COMPONENT), "a second Component under deploy/");
            continue;
        }
        let resources_use_it = strings(&doc["resources"])
            .iter()
            .filter(|r| is_yaml(Path::new(r)))
            .any(|r| std::fs::read_to_string(deploy.join(dir).join(r)).unwrap_or_else(|e| panic!("deploy/{}/{r}: {e}", dir.display())).contains(PLACEHOLDER));
        let pulls_it = strings(&doc["components"]).iter().any(|c| deploy.join(dir).join(c).canonicalize().ok().as_ref() == Some(&component));
        assert_eq!(
            resources_use_it,
            pulls_it,
            "deploy/{}: its manifests name the image's placeholder: {resources_use_it}; it pulls in deploy/{COMPONENT}: {pulls_it}",
            dir.display()
        );
        if pulls_it {
            users.push(dir.clone());
        }
    }
    users.sort();
    assert_eq!(users, [PathBuf::from(""), PathBuf::from("cleanup")], "the kustomizations that pull in deploy/{COMPONENT}");
}

/// What `kubectl apply -k` would apply: the Component's image in every pod of
/// deploy/ and deploy/cleanup/, before and after the Component alone is changed.
#[test]
fn kustomize_renders_the_components_image() {
    if std::process::Command::new("kubectl").arg("version").arg("--client").output().is_err() {
        eprintln!("skipping the rendering: no kubectl on PATH (the file checks above still ran)");
        return;
    }
    let deploy = deploy_dir();
    let (name, tag) = component_image(&deploy);
    let render = |root: &Path, want: &str| {
        for dir in [root.to_owned(), root.join("cleanup")] {
            let images = pod_images(&kustomize(&dir).unwrap());
            assert!(!images.is_empty(), "{}: no pods", dir.display());
            assert!(images.iter().all(|i| i == want), "kubectl kustomize {}: {images:?}, not {want}", dir.display());
        }
    };
    render(&deploy, &format!("{name}:{tag}"));

    // A copy of deploy/ whose Component names a registry's image: both follow.
    let copy = std::env::temp_dir().join(format!("vip-deploy-image-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&copy);
    for f in files(&deploy) {
        let to = copy.join(&f);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(deploy.join(&f), &to).unwrap();
    }
    let file = copy.join(COMPONENT).join("kustomization.yaml");
    let text = std::fs::read_to_string(&file).unwrap();
    let changed = text.replace(&format!("newName: {name}"), "newName: registry.example/team/vip-agent").replace(&format!("newTag: {tag}"), "newTag: 9.9.9");
    assert_ne!(text, changed);
    std::fs::write(&file, changed).unwrap();
    render(&copy, "registry.example/team/vip-agent:9.9.9");
    std::fs::remove_dir_all(&copy).unwrap();
}
