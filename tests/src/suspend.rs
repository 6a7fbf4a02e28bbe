//! A host suspend, played on one process: [`Suspender::suspend`] stops it (SIGSTOP) and
//! [`Suspended::resume`] continues it (SIGCONT) with its `CLOCK_MONOTONIC` held back by the
//! time it was stopped, so that, as after a suspend of its host, its monotonic clock (tokio's
//! and std's `Instant`) did not move while `CLOCK_BOOTTIME` and the wall clock did. The clock
//! is held back by a small `LD_PRELOAD` library (`suspend_shim.c`, compiled with the `cc` the
//! Rust toolchain links with) that reads the amount from a file the test writes while the
//! process is stopped. What a real suspend also freezes — the host's other processes and its
//! kernel's TCP timers — is not played: the other processes of a test are other hosts.

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How much monotonic time the process sees pass across a suspend: a little, never less than
/// none (its last reading came before the stop was confirmed).
const SEEN_TO_PASS: Duration = Duration::from_millis(20);

/// The compiled shim, once per test binary.
static SHIM: OnceLock<PathBuf> = OnceLock::new();

fn shim() -> &'static Path {
    SHIM.get_or_init(|| {
        let dir = std::env::temp_dir().join("drumline-tests");
        fs::create_dir_all(&dir).expect("mkdir");
        let source = dir.join(format!("suspend-shim-{}.c", std::process::id()));
        let library = dir.join(format!("suspend-shim-{}.so", std::process::id()));
        fs::write(&source, include_str!("suspend_shim.c")).expect("write the shim");
        let mut cc = Command::new("cc");
        cc.args(["-shared", "-fPIC", "-O2", "-o"]);
        cc.arg(&library).arg(&source).arg("-ldl");
        // cc is the C compiler Rust links with.
        crate::scenario::run_checked(&mut cc, "compiling the suspend shim with cc");
        let _ = fs::remove_file(&source);
        library
    })
}

/// What makes one process suspendable: its environment and the file its clock reads.
pub struct Suspender {
    file: PathBuf,
}

impl Suspender {
    /// A suspender whose file lives in `dir` (a test's scratch directory).
    pub fn new(dir: &Path) -> Self {
        let file = dir.join("suspend-held-back");
        fs::write(&file, 0i64.to_le_bytes()).expect("write the held-back file");
        Self { file }
    }

    /// The environment to start the process with.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LD_PRELOAD", shim().display().to_string()),
            ("SUSPEND_SHIM_FILE", self.file.display().to_string()),
        ]
    }

    /// Stops process `pid` (started with [`env`](Self::env)) and waits until it is stopped.
    pub fn suspend(&self, pid: i32) -> Suspended<'_> {
        signal(pid, "-STOP");
        let stopped = crate::wait_until(Duration::from_secs(5), || state(pid) == Some('T'));
        assert!(stopped, "{pid} did not stop");
        Suspended {
            suspender: self,
            pid,
            since: Instant::now(),
        }
    }

    fn held_back(&self) -> i64 {
        let bytes = fs::read(&self.file).expect("read the held-back file");
        i64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"))
    }
}

/// A stopped process (see [`Suspender::suspend`]).
pub struct Suspended<'a> {
    suspender: &'a Suspender,
    pid: i32,
    since: Instant,
}

impl Suspended<'_> {
    /// Holds the process's monotonic clock back by the time it was stopped (but
    /// [`SEEN_TO_PASS`]) and continues it; returns how long it was stopped.
    pub fn resume(self) -> Duration {
        let slept = self.since.elapsed();
        let more = slept.saturating_sub(SEEN_TO_PASS).as_nanos() as i64;
        let total = self.suspender.held_back() + more;
        // Written in place: the process maps the file, and must never see it shorter.
        let mut file = OpenOptions::new()
            .write(true)
            .open(&self.suspender.file)
            .expect("open the held-back file");
        file.seek(SeekFrom::Start(0)).expect("seek");
        file.write_all(&total.to_le_bytes()).expect("write");
        file.sync_all().expect("sync");
        signal(self.pid, "-CONT");
        slept
    }
}

fn signal(pid: i32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {signal} {pid}");
}

/// The state letter of `/proc/<pid>/stat` (`T`: stopped).
fn state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::process::{Child, ChildStdout, Stdio};

    /// Python's `time.clock_gettime` goes through the C library, as Rust's does.
    const PROBE: &str = "import sys, time\n\
        for _ in sys.stdin:\n\
        \x20   print(time.clock_gettime(time.CLOCK_MONOTONIC), time.clock_gettime(time.CLOCK_BOOTTIME), flush=True)\n";

    fn read(child: &mut Child, out: &mut BufReader<ChildStdout>) -> (f64, f64) {
        writeln!(child.stdin.as_mut().unwrap()).unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let mut values = line.split_whitespace().map(|v| v.parse::<f64>().unwrap());
        (values.next().unwrap(), values.next().unwrap())
    }

    #[test]
    fn a_suspended_process_sees_boot_time_pass_and_monotonic_time_not() {
        let dir = std::env::temp_dir()
            .join("drumline-tests")
            .join(format!("suspend-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let suspender = Suspender::new(&dir);
        let mut child = Command::new("python3")
            .args(["-c", PROBE])
            .envs(suspender.env())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let (mono, boot) = read(&mut child, &mut out);
        let suspended = suspender.suspend(child.id() as i32);
        // The fault itself: the host sleeps for half a second.
        std::thread::sleep(Duration::from_millis(500));
        let slept = suspended.resume();
        let (mono_after, boot_after) = read(&mut child, &mut out);
        let _ = child.kill();
        let _ = child.wait();
        let _ = fs::remove_dir_all(&dir);
        assert!(
            boot_after - boot >= slept.as_secs_f64(),
            "{boot} → {boot_after}"
        );
        assert!(
            mono_after - mono < 0.25,
            "monotonic time passed across the suspend: {mono} → {mono_after}"
        );
        assert!(
            mono_after >= mono,
            "monotonic time went back: {mono} → {mono_after}"
        );
    }
}
