;;;; cpus.lisp -- how much CPU this process may use.
;;;;
;;;; The pool sizes its run permits by the CPUs it may use, and grows only
;;;; while the process uses less than that (pool/maker.lisp).  Two limits apply:
;;;; the affinity mask (taskset, cpusets) and the CPU quota of the process's
;;;; cgroup (a container started with --cpus=0.5, systemd's CPUQuota=).  With
;;;; only the first, a server limited to half a core would see itself at
;;;; 50% load while it is in fact saturated, conclude that its workers are
;;;; blocked, and add threads up to MAX-THREADS.
;;;;
;;;; The quota is read from the cgroup files: cgroup v2's cpu.max ("QUOTA
;;;; PERIOD" or "max PERIOD"), cgroup v1's cpu.cfs_quota_us and
;;;; cpu.cfs_period_us (a quota of -1 means none).  The process's cgroup comes
;;;; from /proc/self/cgroup; the quota of the nearest cgroup on the way up to
;;;; the hierarchy's root that has one applies.  Anything unreadable counts
;;;; as "no quota".

(in-package #:gallop.core)

(defun read-file-line (path)
  "The first line of the file at PATH, or NIL if it cannot be read."
  (ignore-errors
   (with-open-file (in path :if-does-not-exist nil)
     (and in (read-line in nil nil)))))

(defun parse-integer-or-nil (string)
  (and string (ignore-errors (parse-integer string))))

(defun parse-cgroup-v2-max (line)
  "CPUs allowed by a cgroup v2 cpu.max LINE (\"50000 100000\"), or NIL for
\"max ...\" or anything malformed."
  (let* ((space (and line (position #\Space line)))
         (quota (and space (parse-integer-or-nil (subseq line 0 space))))
         (period (and space (parse-integer-or-nil (subseq line (1+ space))))))
    (and quota period (plusp quota) (plusp period)
         (/ quota period))))

(defun parse-cgroup-v1-quota (quota-line period-line)
  "CPUs allowed by cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us lines,
or NIL (a quota of -1 means none)."
  (let ((quota (parse-integer-or-nil quota-line))
        (period (parse-integer-or-nil period-line)))
    (and quota period (plusp quota) (plusp period)
         (/ quota period))))

(defun cgroup-paths (text)
  "From the text of /proc/self/cgroup, the cgroup v2 path and the cgroup v1
path of the cpu controller (either may be NIL)."
  (let ((v2 nil) (v1 nil))
    (with-input-from-string (in text)
      (loop for line = (read-line in nil nil)
            while line
            do (let* ((c1 (position #\: line))
                      (c2 (and c1 (position #\: line :start (1+ c1)))))
                 (when c2
                   (let ((controllers (subseq line (1+ c1) c2))
                         (path (subseq line (1+ c2))))
                     (cond ((and (string= (subseq line 0 c1) "0") (string= controllers ""))
                            (setf v2 path))
                           ((member "cpu" (split-commas controllers) :test #'string=)
                            (setf v1 path))))))))
    (values v2 v1)))

(defun split-commas (string)
  (loop with start = 0
        for comma = (position #\, string :start start)
        collect (subseq string start comma)
        while comma
        do (setf start (1+ comma))))

(defun path-ancestors (path)
  "PATH (\"/a/b\"), then its parents up to \"\" (the root), as strings
without a trailing slash."
  (let ((path (string-right-trim "/" path)))
    (loop collect path
          while (plusp (length path))
          do (setf path (subseq path 0 (or (position #\/ path :from-end t) 0))))))

(defun nearest-quota (root path reader)
  "The first quota READER finds in ROOT+PATH or one of its ancestors."
  (loop for dir in (path-ancestors path)
        thereis (funcall reader (concatenate 'string root dir "/"))))

(defun cgroup-cpu-quota ()
  "The CPUs (a rational, e.g. 1/2) the cgroup quota of this process allows,
or NIL if there is none or it cannot be read."
  (let ((text (ignore-errors
               (with-open-file (in "/proc/self/cgroup" :if-does-not-exist nil)
                 (and in (with-output-to-string (out)
                           (loop for line = (read-line in nil nil)
                                 while line do (write-line line out))))))))
    (when text
      (multiple-value-bind (v2 v1) (cgroup-paths text)
        (or (and v2
                 (nearest-quota "/sys/fs/cgroup" v2
                                (lambda (dir)
                                  (parse-cgroup-v2-max
                                   (read-file-line (concatenate 'string dir "cpu.max"))))))
            (and v1
                 (loop for root in '("/sys/fs/cgroup/cpu" "/sys/fs/cgroup/cpu,cpuacct")
                       thereis (nearest-quota
                                root v1
                                (lambda (dir)
                                  (parse-cgroup-v1-quota
                                   (read-file-line (concatenate 'string dir "cpu.cfs_quota_us"))
                                   (read-file-line (concatenate 'string dir "cpu.cfs_period_us"))))))))))))

(defun usable-cpus ()
  "The CPUs this process may use: its affinity mask's count, lowered by its
cgroup's CPU quota.  A positive rational (1/2 under --cpus=0.5)."
  (let ((affinity (allowed-cpu-count))
        (quota (cgroup-cpu-quota)))
    (if quota (min affinity quota) affinity)))

;;; Which threads want a CPU.  Busy workers and a process below its CPUs can
;;; mean blocked handlers (sleeping, waiting on a database: more threads
;;; help) or a machine whose CPUs other processes use too (more threads only
;;; wait longer for them).  The kernel's state of each thread tells them
;;; apart: R (running, or runnable and waiting for a CPU) or not.

(defconstant +proc-stat-state-offset+ 2
  "In /proc/self/task/TID/stat the state letter follows the command name's
closing parenthesis and a space.")

(sb-alien:define-alien-routine ("open" %open) sb-alien:int
  (path sb-sys:system-area-pointer) (flags sb-alien:int))

(defun thread-proc-path (tid file)
  "The path of /proc/self/task/TID/FILE as octets ending in a NUL."
  (let ((path (format nil "/proc/self/task/~D/~A" tid file)))
    (map '(simple-array (unsigned-byte 8) (*)) #'char-code
         (concatenate 'string path (string (code-char 0))))))

(defun thread-stat-path (tid)
  "The path of /proc/self/task/TID/stat as octets ending in a NUL, for
THREAD-RUNNABLE-P: made once per thread, so that the maker's look at a
thread formats and encodes no string (doc/design.md, \"The maker's
looks\")."
  (thread-proc-path tid "stat"))

(defun thread-syscall-path (tid)
  "The path of /proc/self/task/TID/syscall as octets ending in a NUL, for
THREAD-WAIT-KIND, made once per thread."
  (thread-proc-path tid "syscall"))

(defun read-proc-file (path buffer)
  "Read the start of the file at PATH (octets ending in a NUL) into BUFFER,
without a stream: the octets read, or NIL if it can't be opened or read."
  (declare (type octets path buffer))
  (let ((fd (sb-sys:with-pinned-objects (path)
              (%open (sb-sys:vector-sap path) (logior sb-unix:o_rdonly +o-cloexec+)))))
    (when (>= fd 0)
      (let ((n (unwind-protect
                    (sb-sys:with-pinned-objects (buffer)
                      (%read fd (sb-sys:vector-sap buffer) (length buffer)))
                 (close-fd fd))))
        (and (plusp n) (min n (length buffer)))))))

(defun thread-runnable-p (path buffer)
  "True when the thread whose stat file is at PATH (THREAD-STAT-PATH) is
running or waiting for a CPU (state R).  BUFFER is an octet vector of at
least 64 octets to read into.  NIL if its stat file can't be read (the
thread has just exited)."
  (declare (type octets path buffer))
  (let ((n (read-proc-file path buffer)))
    (when n
      ;; The command name may hold any character but is at most 16
      ;; octets, so its closing parenthesis is within the first 64.
      (let ((paren (loop for i of-type fixnum from (1- n) downto 0
                         when (= (aref buffer i) 41) ; #\)
                           return i)))
        (and paren (< (+ paren +proc-stat-state-offset+) n)
             (= (aref buffer (+ paren +proc-stat-state-offset+)) 82)))))) ; #\R

;;; How a blocked thread waits.  A thread that is not R may be sleeping in
;;; its handler or waiting on a socket (a system call), waiting on a futex
;;; (a mutex, a semaphore, a condition variable), or stopped outside any
;;; system call (a page fault waiting for the address space's lock).  A
;;; handler may wait on a semaphore for long (a database pool), but a futex
;;; wait, like a page fault's wait, is also what a thread does for
;;; microseconds to milliseconds when a lock's holder is preempted, and on a
;;; machine shared with other processes that happens to handlers that never
;;; block (POOL: CONFIRMED-BLOCKED).  /proc/self/task/TID/syscall names the
;;; system call a blocked thread is in, -1 when it is blocked outside one,
;;; "running" when it is not blocked; only the thread's own process may read
;;; it, which is all the pool needs.

(defconstant +futex-syscall+
  #+x86-64 202 #+arm64 98 #-(or x86-64 arm64) -2
  "futex(2)'s system call number on this architecture (-2: unknown, no thread
is ever taken to be in it).")

(defun thread-wait-kind (path buffer)
  "How the thread whose syscall file is at PATH (THREAD-SYSCALL-PATH) waits:
:CALL inside a system call other than futex(2); :BRIEF inside futex(2) or
blocked outside any system call (see above); :RUNNING not blocked (it woke
since its state was read); NIL if the file can't be read or parsed.
BUFFER is an octet vector of at least 16 octets."
  (declare (type octets path buffer))
  (let ((n (read-proc-file path buffer)))
    ;; The file begins with the call's number in decimal (-1 outside a
    ;; call), then a space; or with "running".
    (when n
      (cond ((= (aref buffer 0) 114) :running) ; #\r
            ((= (aref buffer 0) 45) :brief)    ; #\-
            (t (let ((number 0))
                 (declare (type fixnum number))
                 (loop for i of-type fixnum below (min n 8)
                       for octet = (aref buffer i)
                       do (cond ((<= 48 octet 57)
                                 (setf number (+ (* number 10) (- octet 48))))
                                ((and (= octet 32) (plusp i))
                                 (return (if (= number +futex-syscall+) :brief :call)))
                                (t (return nil))))))))))

;;; Whether the CPUs have time to spare.  Serving workers seen runnable
;;; (state R) beyond +RUNNABLE-PER-CPU+ per CPU keep a group from growing
;;; (BLOCKED-WORKERS), and so do runnable holders as many as the blocked
;;; ones (RESIZE-GROUP): they wait for a CPU.  But a state is a snapshot, and
;;; workers whose handlers sleep wake in bursts: looks 5 ms apart may find
;;; too many workers runnable every other time while the CPUs sit idle for a
;;; good share of the time, and the pool then stops short of what the load
;;; needs (doc/design.md, "Idle CPUs and the pool's load").  A burst is not
;;; saturation when the CPUs went idle meanwhile: a runnable thread waits for
;;; a CPU only while none is idle.  So the maker
;;; also reads, every +IDLE-READ-MS+, the idle time of the CPUs the process
;;; may run on from /proc/stat (clock ticks: idle and iowait, against all the
;;; time of those CPUs), and when they were idle at least +IDLE-CPUS-SHARE+
;;; of the last two readings' interval, any blocked worker is reason enough
;;; to grow.  On a machine whose CPUs other processes keep busy they are
;;; never idle, and nothing changes.  Under a cgroup CPU quota the CPUs may
;;; be idle while the process may not use them: there the idle time says
;;; nothing, and is not read.

(defconstant +idle-read-ms+ 100
  "How often the maker reads its CPUs' idle time (IDLE-METER): the share is
over the last two intervals, 20 clock ticks per CPU, so that one tick, the
unit of /proc/stat, is 5% of a CPU at most.")

(defconstant +idle-cpus-share+ 1/10
  "Share of their time the CPUs the process may use must have been idle for
runnable workers not to count as waiting for a CPU (see above).")

(defun parse-cpus-idle (buffer end mask)
  "From the text of /proc/stat in BUFFER[0,END): the clock ticks the CPUs
whose bits are set in MASK (an integer, bit N for CPU N) spent idle (its
idle and iowait fields) and in all (user, nice, system, idle, iowait, irq,
softirq and steal: the guest fields are counted in user already), as two
values.  Lines other than \"cpuN ...\", and a last line cut short without
its newline, count for nothing."
  (declare (type octets buffer) (type fixnum end) (type integer mask))
  (let ((idle 0) (total 0) (i 0))
    (declare (type fixnum i) (type (integer 0) idle total))
    (flet ((digit (k)
             (declare (type fixnum k))
             (and (< k end) (<= 48 (aref buffer k) 57) (- (aref buffer k) 48))))
      (loop while (< i end)
            do (let ((line-end (or (position 10 buffer :start i :end end) end)))
                 (declare (type fixnum line-end))
                 (when (and (< line-end end)
                            (< (+ i 3) line-end)
                            (= (aref buffer i) 99) (= (aref buffer (+ i 1)) 112) ; "cp"
                            (= (aref buffer (+ i 2)) 117)                        ; "u"
                            (digit (+ i 3)))
                   (let ((k (+ i 3)) (cpu 0))
                     (declare (type fixnum k cpu))
                     (loop for d = (digit k) while d
                           do (setf cpu (+ (* 10 cpu) d)) (incf k))
                     (when (logbitp cpu mask)
                       ;; Up to eight fields, each after one or more spaces.
                       (loop for field of-type fixnum from 0 below 8
                             do (loop while (and (< k line-end) (= (aref buffer k) 32))
                                      do (incf k))
                                (unless (digit k) (return))
                                (let ((n 0))
                                  (declare (type (integer 0) n))
                                  (loop for d = (and (< k line-end) (digit k)) while d
                                        do (setf n (+ (* 10 n) d)) (incf k))
                                  (incf total n)
                                  (when (or (= field 3) (= field 4))
                                    (incf idle n)))))))
                 (setf i (1+ line-end)))))
    (values idle total)))

(defstruct (idle-meter (:constructor make-idle-meter ()) (:copier nil))
  "The maker's readings of the idle time of the CPUs in MASK: the last two,
+IDLE-READ-MS+ apart, as (idle . total) clock ticks.  A reading of another
mask (the affinity changed) starts over."
  (mask 0 :type integer)
  (buffer (make-array 0 :element-type '(unsigned-byte 8)) :type octets)
  (last nil)
  (before-last nil))

(defmethod print-object ((meter idle-meter) stream)
  (print-unreadable-object (meter stream :type t :identity t)))

(sb-ext:define-load-time-global *proc-stat-path*
    (map 'octets #'char-code (format nil "/proc/stat~C" (code-char 0)))
  "/proc/stat as octets ending in a NUL, for READ-PROC-FILE.")

(defun idle-meter-share (meter mask)
  "Read the idle time of the CPUs in MASK into METER; the share of their
time they were idle between the reading before last and this one, or NIL
when not known (fewer than three readings of this mask, or /proc/stat can't
be read)."
  (unless (eql mask (idle-meter-mask meter))
    ;; Room for the lines of CPUs up to the highest in MASK: a line is at
    ;; most 11 fields of 20 digits.
    (setf (idle-meter-mask meter) mask
          (idle-meter-buffer meter) (make-array (* 256 (+ 2 (integer-length mask)))
                                                :element-type '(unsigned-byte 8))
          (idle-meter-last meter) nil
          (idle-meter-before-last meter) nil))
  (let ((n (read-proc-file *proc-stat-path* (idle-meter-buffer meter))))
    (if (null n)
        (setf (idle-meter-last meter) nil (idle-meter-before-last meter) nil)
        (multiple-value-bind (idle total) (parse-cpus-idle (idle-meter-buffer meter) n mask)
          (let ((then (shiftf (idle-meter-before-last meter) (idle-meter-last meter)
                              (cons idle total))))
            (and then (> total (cdr then))
                 (/ (- idle (car then)) (- total (cdr then)))))))))
