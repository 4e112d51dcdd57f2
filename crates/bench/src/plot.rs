//! PNG plots of a [`Report`], drawn with plotters' pure-Rust bitmap backend:
//!
//! * `ttft_cdf.png` (and `ttft_cdf_<run>.png` for further runs): TTFT CDF per policy;
//! * `load_sweep.png`: hit rate and TTFT p50 against offered load, when a sweep ran;
//! * `replica_load.png` (per run): each replica's outstanding requests over time, a panel per
//!   policy.
//!
//! Text goes through `ab_glyph` with a TrueType font read at run time (`KINFERENCE_FONT`, or
//! DejaVu Sans / Liberation Sans where the system has them), so nothing links against
//! fontconfig or freetype. Without a font the plots are drawn without any text.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::error::BenchError;
use crate::report::{Report, RunReport};

const W: u32 = 1000;
const H: u32 = 650;

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers a font for plot text once; false when none could be loaded.
pub fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let env = std::env::var_os("KINFERENCE_FONT").map(PathBuf::from);
        let paths = env
            .into_iter()
            .chain(FONT_CANDIDATES.iter().map(PathBuf::from));
        for p in paths {
            let Ok(bytes) = std::fs::read(&p) else {
                continue;
            };
            // plotters keeps fonts for the life of the process; one leak per process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
        false
    })
}

fn perr(e: impl std::fmt::Display) -> BenchError {
    BenchError::Report(format!("plot: {e}"))
}

fn colour(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

/// Writes every plot of `report` into `dir`; returns the files written.
pub fn write_plots(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    let text = font_available();
    let mut out = Vec::new();
    for (i, run) in report.runs.iter().enumerate() {
        let suffix = if i == 0 {
            String::new()
        } else {
            format!("_{}", slug(&run.label))
        };
        let p = dir.join(format!("ttft_cdf{suffix}.png"));
        ttft_cdf(run, &p, text)?;
        out.push(p);
        if run.policies.iter().any(|p| p.timeline.is_some()) {
            let p = dir.join(format!("replica_load{suffix}.png"));
            replica_load(run, &p, text)?;
            out.push(p);
        }
    }
    if report.runs.len() >= 2 {
        let p = dir.join("load_sweep.png");
        load_sweep(&report.runs, &p, text)?;
        out.push(p);
    }
    Ok(out)
}

fn slug(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The range of the positive, finite samples, padded by 10 %; 1 ms to 1 s when there are none.
fn log_range(samples: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = samples
        .filter(|x| x.is_finite() && *x > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
    if lo.is_finite() && hi > lo {
        (lo * 0.9, hi * 1.1)
    } else {
        (1e-3, 1.0)
    }
}

/// The empirical CDF of the positive, finite samples, at most ~2,000 points (enough for a
/// smooth curve).
fn cdf_points(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples
        .iter()
        .copied()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    v.sort_by(f64::total_cmp);
    let n = v.len().max(1) as f64;
    let step = (v.len() / 2000).max(1);
    v.iter()
        .enumerate()
        .filter(|(k, _)| k % step == 0 || *k + 1 == v.len())
        .map(|(k, x)| (*x, (k + 1) as f64 / n))
        .collect()
}

fn ttft_cdf(run: &RunReport, path: &Path, text: bool) -> Result<(), BenchError> {
    let root = BitMapBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let (lo, hi) = log_range(
        run.policies
            .iter()
            .flat_map(|p| p.ttft_samples.iter().copied()),
    );
    let mut b = ChartBuilder::on(&root);
    b.margin(20);
    if text {
        b.caption(format!("TTFT CDF — {}", run.label), ("sans-serif", 24))
            .x_label_area_size(45)
            .y_label_area_size(60);
    }
    let mut chart = b
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
        .map_err(perr)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("time to first token (s, log scale)")
            .y_desc("fraction of requests");
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(perr)?;
    for (i, p) in run.policies.iter().enumerate() {
        let c = colour(i);
        let series = chart
            .draw_series(LineSeries::new(
                cdf_points(&p.ttft_samples),
                c.stroke_width(2),
            ))
            .map_err(perr)?;
        if text {
            series
                .label(p.result.policy.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(perr)?;
    }
    root.present().map_err(perr)
}

fn replica_load(run: &RunReport, path: &Path, text: bool) -> Result<(), BenchError> {
    let root = BitMapBackend::new(path, (W, H.max(300 * run.policies.len() as u32 / 2)))
        .into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let n = run.policies.len().max(1);
    let cols = if n > 1 { 2 } else { 1 };
    let rows = n.div_ceil(cols);
    let panels = root.split_evenly((rows, cols));
    for (p, area) in run.policies.iter().zip(panels.iter()) {
        let Some(tl) = &p.timeline else { continue };
        let t_max = tl.t.last().copied().unwrap_or(1.0).max(1e-3);
        let y_max = tl
            .per_replica
            .iter()
            .flat_map(|s| s.iter().copied())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut b = ChartBuilder::on(area);
        b.margin(10);
        if text {
            b.caption(
                format!("{}: outstanding requests per replica", p.result.policy),
                ("sans-serif", 16),
            )
            .x_label_area_size(30)
            .y_label_area_size(40);
        }
        let mut chart = b
            .build_cartesian_2d(0.0..t_max, 0u32..(y_max + y_max / 10 + 1))
            .map_err(perr)?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc("s").x_labels(6).y_labels(5);
        } else {
            mesh.disable_x_axis().disable_y_axis();
        }
        mesh.draw().map_err(perr)?;
        for (r, series) in tl.per_replica.iter().enumerate() {
            let pts: Vec<(f64, u32)> = tl.t.iter().copied().zip(series.iter().copied()).collect();
            chart
                .draw_series(LineSeries::new(pts, colour(r).stroke_width(1)))
                .map_err(perr)?;
        }
    }
    root.present().map_err(perr)
}

type SweepChart<'b, 'c> = ChartContext<
    'b,
    BitMapBackend<'c>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The sweep's shared x axis and series: one point per run, one line per policy of the first.
struct Sweep<'a> {
    runs: &'a [RunReport],
    /// The target load where set, else the run's position.
    xs: Vec<f64>,
    x_range: std::ops::Range<f64>,
    names: Vec<String>,
    text: bool,
}

impl Sweep<'_> {
    /// The hit rate (%) or the TTFT p50 (s) of policy `name` in run `r`.
    fn metric(r: &RunReport, name: &str, hit: bool) -> Option<f64> {
        r.policies
            .iter()
            .find(|p| p.result.policy == name)
            .and_then(|p| {
                if hit {
                    Some(p.result.hit_rate * 100.0)
                } else {
                    p.result.ttft_p50_s
                }
            })
    }

    /// A panel's chart with its mesh drawn, the y axis up to the highest value plus 10 %.
    fn axes<'b, 'c>(
        &self,
        area: &'b DrawingArea<BitMapBackend<'c>, Shift>,
        hit: bool,
    ) -> Result<SweepChart<'b, 'c>, BenchError> {
        let y1 = self
            .runs
            .iter()
            .flat_map(|r| {
                self.names
                    .iter()
                    .filter_map(move |n| Self::metric(r, n, hit))
            })
            .fold(0.0f64, f64::max)
            * 1.1
            + 1e-3;
        let mut b = ChartBuilder::on(area);
        b.margin(15);
        if self.text {
            let caption = if hit {
                "prefix-cache hit rate (%)"
            } else {
                "TTFT p50 (s)"
            };
            b.caption(caption, ("sans-serif", 20))
                .x_label_area_size(40)
                .y_label_area_size(50);
        }
        let mut chart = b
            .build_cartesian_2d(self.x_range.clone(), 0.0..y1)
            .map_err(perr)?;
        let mut mesh = chart.configure_mesh();
        if self.text {
            mesh.x_desc(if self.runs.iter().all(|r| r.load.is_some()) {
                "offered load (fraction of fleet capacity)"
            } else {
                "run"
            });
        } else {
            mesh.disable_x_axis().disable_y_axis();
        }
        mesh.draw().map_err(perr)?;
        Ok(chart)
    }

    /// One panel: hit rate (`hit`) or TTFT p50 against the x axis, a line per policy.
    fn panel(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, Shift>,
        hit: bool,
    ) -> Result<(), BenchError> {
        let (runs, text) = (self.runs, self.text);
        let mut chart = self.axes(area, hit)?;
        for (i, name) in self.names.iter().enumerate() {
            let pts: Vec<(f64, f64)> = runs
                .iter()
                .zip(&self.xs)
                .filter_map(|(r, x)| Self::metric(r, name, hit).map(|y| (*x, y)))
                .collect();
            let c = colour(i);
            let s = chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(perr)?;
            if text {
                s.label(name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
            }
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
                .map_err(perr)?;
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(perr)?;
        }
        Ok(())
    }
}

fn load_sweep(runs: &[RunReport], path: &Path, text: bool) -> Result<(), BenchError> {
    let root = BitMapBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let (left, right) = root.split_horizontally(W / 2);
    let xs: Vec<f64> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| r.load.unwrap_or(i as f64))
        .collect();
    let (x0, x1) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(*x), b.max(*x))
        });
    let pad = ((x1 - x0) * 0.05).max(0.01);
    let sweep = Sweep {
        runs,
        xs,
        x_range: (x0 - pad)..(x1 + pad),
        names: runs
            .first()
            .map(|r| r.policies.iter().map(|p| p.result.policy.clone()).collect())
            .unwrap_or_default(),
        text,
    };
    sweep.panel(&left, true)?;
    sweep.panel(&right, false)?;
    root.present().map_err(perr)
}
