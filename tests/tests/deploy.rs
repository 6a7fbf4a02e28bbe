//! `deploy/` is checked, not just shipped (docs/operations.md#deploying): the systemd units
//! (and `systemd-analyze verify` where it exists), the Kubernetes manifests, and the Grafana
//! dashboard, whose every metric must be one the binaries export.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::scenario::tails;
use drumline_e2e::{binary, http_get, setup, wait_until, Proc, TestEnv};
use serde_yaml::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn deploy(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(path)
}

/// `Key=value` lines of a unit file, comments and sections left out.
fn unit_keys(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

#[test]
fn systemd_units_notify_with_a_watchdog_and_verify() {
    let dir = std::env::temp_dir().join(format!("drumline-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for bin in ["drumline-beat", "drumline-worker"] {
        let text = std::fs::read_to_string(deploy(&format!("systemd/{bin}.service"))).unwrap();
        let keys = unit_keys(&text);
        let get = |k: &str| {
            keys.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("Type"), Some("notify"), "{bin}");
        let watchdog: u64 = get("WatchdogSec").expect("WatchdogSec").parse().unwrap();
        assert!(watchdog > 0, "{bin}");
        let exec = get("ExecStart").expect("ExecStart");
        let role = bin.trim_start_matches("drumline-");
        let installed = format!("/usr/local/bin/drumline {role} ");
        assert!(exec.starts_with(&installed), "{exec}");
        assert!(exec.contains("--metrics-addr"), "{exec}");
        assert_eq!(get("RestartPreventExitStatus"), Some("2"), "{bin}");
        assert!(get("User").is_some_and(|u| u != "root"), "{bin}");
        // The real binary where the unit expects it, for the verifier.
        let built = format!("{}/", binary("drumline").parent().unwrap().display());
        let local = text.replace("/usr/local/bin/", &built);
        std::fs::write(dir.join(format!("{bin}.service")), local).unwrap();
    }
    systemd_analyze_verify(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `systemd-analyze verify` of both units in `dir`, which must pass where the tool exists.
fn systemd_analyze_verify(dir: &std::path::Path) {
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.join("drumline-beat.service"))
        .arg(dir.join("drumline-worker.service"))
        .output();
    match verify {
        Ok(out) => assert!(
            out.status.success() && out.stderr.is_empty(),
            "systemd-analyze verify: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("systemd-analyze not run ({e}); the units were only parsed"),
    }
}

/// Every document of every manifest in deploy/kubernetes/.
fn manifests() -> Vec<Value> {
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(deploy("kubernetes")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            docs.push(serde::Deserialize::deserialize(doc).expect("valid YAML"));
        }
    }
    docs
}

fn find<'v>(docs: &'v [Value], kind: &str, name: &str) -> &'v Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Deployment `name` among `docs`: `replicas` (when given), its selector matching its pods,
/// its container running `name` with both probes on `/healthz`, the URLs from the Secret, the
/// config from the ConfigMap at the path `--config` names, and an argument addressing the
/// container's port.
fn assert_deployment(docs: &[Value], name: &str, replicas: Option<u64>) {
    let deployment = find(docs, "Deployment", name);
    assert_eq!(deployment["apiVersion"], "apps/v1");
    let spec = &deployment["spec"];
    if let Some(n) = replicas {
        assert_eq!(spec["replicas"].as_u64(), Some(n), "{name}");
    }
    assert_eq!(
        spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"],
        "{name}"
    );
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    let role = name.trim_start_matches("drumline-");
    let command = serde_yaml::to_value(["drumline", role]).expect("yaml");
    assert_eq!(container["command"], command, "{name}");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(
            container[probe]["httpGet"]["path"], "/healthz",
            "{name} {probe}"
        );
    }
    assert_eq!(
        container["envFrom"][0]["secretRef"]["name"], "drumline-urls",
        "{name}"
    );
    assert_eq!(pod["volumes"][0]["configMap"]["name"], "drumline-config");
    let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap();
    let args: Vec<&str> = container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.windows(2)
            .any(|w| w == ["--config", &format!("{mount}/drumline.toml")]),
        "{args:?}"
    );
    let port = container["ports"][0]["containerPort"].as_u64().unwrap();
    assert!(
        args.iter().any(|a| a.ends_with(&format!(":{port}"))),
        "{args:?}"
    );
}

#[test]
fn kubernetes_manifests_run_two_beats_and_workers_with_probes_config_and_secret() {
    let docs = manifests();
    let config = find(&docs, "ConfigMap", "drumline-config");
    let toml = config["data"]["drumline.toml"]
        .as_str()
        .expect("drumline.toml");
    let secret = find(&docs, "Secret", "drumline-urls");
    for key in ["DRUMLINE_AMQP_URL", "DRUMLINE_REDIS_URL"] {
        assert!(secret["stringData"][key].is_string(), "{key}");
    }
    for (name, replicas) in [("drumline-beat", Some(2)), ("drumline-worker", None)] {
        assert_deployment(&docs, name, replicas);
    }
    // The ConfigMap's config is one drumline accepts.
    let env = setup("e2e_deploy_config");
    let file = env.path("configmap.toml");
    std::fs::write(&file, toml).unwrap();
    let (status, _, stderr) = env.run("drumline", &["--config", file.to_str().unwrap(), "check"]);
    assert!(status.success(), "{stderr}");
}

/// The metric names (as `# TYPE` lines declare them) served on 127.0.0.1:`port`.
fn exported(port: u16) -> BTreeSet<String> {
    let body = http_get(port, "/metrics")
        .map(|(_, body)| body)
        .unwrap_or_default();
    body.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Every `drumline_*` or `process_*` name in a PromQL expression.
fn queried(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("drumline_") || t.starts_with("process_"))
        .map(str::to_owned)
        .collect()
}

/// Every metric the dashboard queries, with the panel expression it is in.
fn dashboard_metrics() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy("grafana/drumline.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert!(dashboard["title"].is_string() && dashboard["uid"].is_string());
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    let mut out = Vec::new();
    for panel in panels {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{panel}");
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            let metrics = queried(expr);
            assert!(!metrics.is_empty(), "no drumline metric in {expr}");
            out.extend(metrics.into_iter().map(|m| (m, expr.to_owned())));
        }
    }
    out
}

/// Whether `metric` (a series name as queried: `_total`, `_bucket`, … included) is declared.
fn declared(names: &BTreeSet<String>, metric: &str) -> bool {
    let base = ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| metric.strip_suffix(s))
        .unwrap_or(metric);
    names.contains(metric) || names.contains(base)
}

/// The (metric, panel) pairs of `queried` whose metric is not among `names`.
fn not_declared(queried: &[(String, String)], names: &BTreeSet<String>) -> Vec<(String, String)> {
    let missing = queried.iter().filter(|(m, _)| !declared(names, m));
    missing.cloned().collect()
}

#[test]
fn the_dashboard_queries_only_metrics_drumline_exports() {
    let env = setup("e2e_deploy_dashboard");
    // A job that runs (published, runs, lag, run time) and one paused (dropped): a labelled
    // family is exported once it has a series.
    let cfg = Cfg::new()
        .task("t", shell("true"))
        .job("tick", every("1s").with("task", "\"t\""))
        .job("held", every("1s").with("task", "\"t\""));
    let cfg = env.config_file(&cfg);
    let (status, _, stderr) = env.run("drumline", &["--config", &cfg, "pause", "held"]);
    assert!(status.success(), "{stderr}");
    let (mut beat, beat_port) = env.beat_serving("beat", &cfg);
    let (mut worker, worker_port) = env.worker_serving("worker", &cfg);
    let queried = dashboard_metrics();
    let names = || &exported(beat_port) | &exported(worker_port);
    let missing = || not_declared(&queried, &names());
    let all = wait_until(Duration::from_secs(30), || missing().is_empty());
    let (missing, names) = (missing(), names());
    assert!(all, "not exported: {missing:?}\nexported: {names:?}");
    worker.terminate(Duration::from_secs(10));
    beat.terminate(Duration::from_secs(10));
}

/// A worker started as systemd starts a `Type=notify` unit: `NOTIFY_SOCKET` (the socket it
/// binds, read with a 30 s timeout) and `vars`.
fn notifying_worker(
    env: &TestEnv,
    vars: &[(&str, &str)],
) -> (Proc, std::os::unix::net::UnixDatagram) {
    let cfg = env.write_config("drumline.toml", &Cfg::new().task("t", shell("true")));
    let socket_path = env.path("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut vars = vars.to_vec();
    vars.push(("NOTIFY_SOCKET", socket_path.to_str().unwrap()));
    let worker = env.worker_with_env("worker", &["--config", cfg.to_str().unwrap()], &vars);
    (worker, socket)
}

#[test]
fn under_systemd_a_worker_says_ready_and_pings_the_watchdog() {
    let env = setup("e2e_deploy_notify");
    let (mut worker, socket) = notifying_worker(&env, &[("WATCHDOG_USEC", "400000")]);
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !(seen.iter().any(|m| m == "READY=1") && seen.iter().any(|m| m == "WATCHDOG=1")) {
        let n = socket.recv(&mut buf).unwrap_or_else(|e| {
            panic!("{e}: only {seen:?}\n{}", tails(&[&worker]));
        });
        seen.push(String::from_utf8_lossy(&buf[..n]).trim().to_owned());
    }
    assert_eq!(seen[0], "READY=1", "{seen:?}");
    worker.terminate(Duration::from_secs(10));
}

/// READY=1 means the worker can already be stopped in order: a SIGTERM the moment systemd hears
/// it ends the worker with exit 0, not the signal's default death.
#[test]
fn a_sigterm_right_after_ready_stops_the_worker_in_order() {
    let env = setup("e2e_deploy_ready_term");
    let (mut worker, socket) = notifying_worker(&env, &[]);
    let mut buf = [0u8; 256];
    let n = socket.recv(&mut buf).expect("READY=1");
    assert_eq!(String::from_utf8_lossy(&buf[..n]).trim(), "READY=1");
    let status = worker.terminate(Duration::from_secs(20));
    assert!(status.success(), "stopped in order: {status}");
}

/// The dashboard picks a namespace and its instances: both are variables, the instances those
/// whose `drumline_build_info` carries the namespace, and every series a panel reads is of the
/// instances picked.
#[test]
fn the_dashboard_filters_by_namespace_and_instance() {
    let text = std::fs::read_to_string(deploy("grafana/drumline.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    let query = |name: &str| {
        let variable = variables.iter().find(|v| v["name"] == name);
        variable.map(|v| v["definition"].as_str().unwrap_or("").to_owned())
    };
    assert_eq!(
        query("namespace").as_deref(),
        Some("label_values(drumline_build_info, namespace)")
    );
    let instances = query("instance").expect("an instance variable");
    assert!(
        instances.contains("namespace=~\"$namespace\""),
        "{instances}"
    );
    for (metric, expr) in dashboard_metrics() {
        let at = expr.find(&metric).expect("queried");
        let selector = &expr[at + metric.len()..];
        assert!(
            selector.starts_with('{')
                && selector[..selector.find('}').unwrap_or(0)].contains("instance=~\"$instance\""),
            "{metric} in {expr}"
        );
    }
}
