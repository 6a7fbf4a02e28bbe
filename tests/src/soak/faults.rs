//! The faults: drawn from the seeded [`Rng`], injected into the [`World`], each printed as it
//! happens, and undone (SIGCONT, a partition healed, a killed process restarted) when due.

use super::rng::Rng;
use super::world::{Member, Role, World};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The kinds of fault, in the order they are reported.
pub const KINDS: [&str; 10] = [
    "kill9-worker",
    "stop-worker",
    "kill9-leader",
    "stop-leader",
    "partition",
    "broker-close-connections",
    "broker-restart",
    "redis-restart",
    "kill9-standby",
    "sentinel-failover",
];

/// How often each kind is drawn (same order as [`KINDS`]).
const WEIGHTS: [u32; 10] = [4, 3, 3, 3, 4, 3, 1, 2, 1, 2];

/// Something to undo later.
#[derive(Debug)]
enum Undo {
    /// SIGCONT member `i` (and its tasks).
    Cont(usize),
    /// Restart member `i`.
    Restart(usize),
    /// Reconnect member `i` (then process `pid`) to Redis.
    Heal(usize, i32),
    /// Restart the killed Redis primary `port` (as a replica).
    Revive(u16),
}

/// The fault schedule and what is pending.
pub struct Faults {
    rng: Rng,
    start: Instant,
    pending: Vec<(Instant, Undo)>,
    /// Faults injected per kind.
    pub counts: BTreeMap<&'static str, usize>,
}

impl Faults {
    /// A schedule decided by `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
            start: Instant::now(),
            pending: Vec::new(),
            counts: KINDS.iter().map(|k| (*k, 0)).collect(),
        }
    }

    /// How long to wait before the next fault.
    pub fn gap(&mut self) -> Duration {
        self.rng
            .between(Duration::from_millis(800), Duration::from_millis(2500))
    }

    /// Draws one fault and injects it.
    pub fn inject(&mut self, world: &mut World) {
        let kind = self.rng.weighted(&WEIGHTS);
        let pick = self.rng.next_u64();
        let length = self
            .rng
            .between(Duration::from_millis(500), Duration::from_millis(7000));
        let leader = leader(world);
        let busy: Vec<usize> = self
            .pending
            .iter()
            .filter_map(|(_, u)| u.member())
            .collect();
        // A Redis fault only on a whole set: one failover at a time, two replicas to take over.
        let redis_whole = world.redis.is_whole();
        let free = |role: Role| -> Vec<usize> {
            (0..world.members.len())
                .filter(|i| world.members[*i].role == role && !busy.contains(i))
                .filter(|i| world.members[*i].proc.is_some())
                .collect()
        };
        let choose =
            |list: Vec<usize>| (!list.is_empty()).then(|| list[pick as usize % list.len()]);
        let standby =
            leader.and_then(|l| choose(free(Role::Beat).into_iter().filter(|b| *b != l).collect()));
        let leader = leader.filter(|l| !busy.contains(l));
        let target = match kind {
            0 | 1 => choose(free(Role::Worker)),
            2 | 3 => leader,
            4 => choose(
                (0..world.members.len())
                    .filter(|i| !busy.contains(i))
                    .collect(),
            ),
            8 => standby,
            7 | 9 if !redis_whole => None,
            _ => Some(usize::MAX),
        };
        let Some(target) = target else { return };
        let at = self.start.elapsed().as_secs_f64();
        let name = |i: usize| {
            world
                .members
                .get(i)
                .map_or(String::new(), |m| m.name.clone())
        };
        println!(
            "[{at:7.2}s] fault {:<25} {} {}",
            KINDS[kind],
            name(target),
            describe(kind, length)
        );
        *self.counts.entry(KINDS[kind]).or_default() += 1;
        let undo = self.apply(kind, target, length, world);
        if let Some(undo) = undo {
            self.pending.push(undo);
        }
    }

    fn apply(
        &mut self,
        kind: usize,
        target: usize,
        length: Duration,
        world: &mut World,
    ) -> Option<(Instant, Undo)> {
        let later = Instant::now() + length;
        match kind {
            0 | 2 | 8 => {
                kill9(&mut world.members[target]);
                Some((later, Undo::Restart(target)))
            }
            1 | 3 => {
                freeze(&world.members[target], true);
                Some((later, Undo::Cont(target)))
            }
            4 => {
                let pid = world.members[target].pid()?;
                world.partition(pid, true);
                Some((later, Undo::Heal(target, pid)))
            }
            5 => {
                world.rabbit.close_connections();
                None
            }
            6 => {
                world.rabbit.restart();
                None
            }
            7 => {
                world.redis.restart_primary();
                None
            }
            _ => {
                let port = world.redis.kill_primary();
                Some((later, Undo::Revive(port)))
            }
        }
    }

    /// Whether something is still to undo.
    pub fn pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Undoes what is due (everything when `all`).
    pub fn undo_due(&mut self, world: &mut World, all: bool) {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = self
            .pending
            .drain(..)
            .partition(|(at, _)| all || *at <= now);
        self.pending = later;
        for (at, undo) in due {
            match undo {
                Undo::Cont(i) => freeze(&world.members[i], false),
                Undo::Heal(_, pid) => world.partition(pid, false),
                Undo::Restart(i) => world.start(i),
                Undo::Revive(port) => {
                    if !world.redis.revive(port) {
                        // Not failed over yet: try again shortly (at the end, until it has).
                        let again = if all {
                            at
                        } else {
                            now + Duration::from_millis(500)
                        };
                        self.pending.push((again, Undo::Revive(port)));
                    }
                }
            }
        }
    }
}

impl Undo {
    fn member(&self) -> Option<usize> {
        match self {
            Undo::Cont(i) | Undo::Restart(i) | Undo::Heal(i, _) => Some(*i),
            Undo::Revive(_) => None,
        }
    }
}

fn describe(kind: usize, length: Duration) -> String {
    match kind {
        0 | 2 | 8 => format!("(restarted after {:.1}s)", length.as_secs_f64()),
        1 | 3 => format!("(SIGCONT after {:.1}s)", length.as_secs_f64()),
        4 => format!("(cut from Redis for {:.1}s)", length.as_secs_f64()),
        9 => format!(
            "(kill -9 of the primary, restarted as a replica after {:.1}s)",
            length.as_secs_f64()
        ),
        _ => String::new(),
    }
}

/// The member whose pid `{ns}:beat:leader` names.
pub fn leader(world: &World) -> Option<usize> {
    let mut conn = world.redis.primary_connection()?;
    let text: Option<String> = redis::cmd("GET")
        .arg(world.env.names().beat_leader())
        .query(&mut conn)
        .ok()?;
    let value: serde_json::Value = serde_json::from_str(&text?).ok()?;
    let pid = value["pid"].as_i64()?;
    world
        .members
        .iter()
        .position(|m| m.pid().map(i64::from) == Some(pid))
}

fn kill9(member: &mut Member) {
    if let Some(mut proc) = member.proc.take() {
        // A frozen process dies of SIGKILL too.
        let _ = proc.kill9();
    }
}

/// SIGSTOP (or SIGCONT) of a member and every process below it (its supervisor and tasks): a
/// frozen host or container, not a process whose children run on.
fn freeze(member: &Member, stop: bool) {
    let Some(pid) = member.pid() else { return };
    let signal = if stop { "-STOP" } else { "-CONT" };
    let mut family = descendants(pid);
    family.push(pid);
    // One `kill` for the whole family; a process gone meanwhile is no matter.
    let _ = std::process::Command::new("kill")
        .arg(signal)
        .args(family.iter().map(i32::to_string))
        .stderr(std::process::Stdio::null())
        .status();
}

/// Every process whose ancestry reaches `root` (read from `/proc/*/stat`).
fn descendants(root: i32) -> Vec<i32> {
    let mut parents: Vec<(i32, i32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: comm may hold spaces, so read after the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            parents.push((pid, ppid));
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found
}
