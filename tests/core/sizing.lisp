;;;; sizing.lisp -- the pool's sizing policy (src/core/pool/sizing.lisp), a pure
;;;; function: each rule on made-up samples, then samples recorded under
;;;; real loads (bench/record-sizing.lisp: beside a CPU hog, handlers that
;;;; block 1 ms then an idle pool, bursts) replayed, decision by decision.
;;;; No load here.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the sizing policy
;;;; (pool/sizing.lisp: DECIDE-SIZE, its samples, state and constants), the
;;;; pure function under test.

(in-package #:gallop-tests)

(in-suite core)

(defun decide (state &rest sample)
  "DECIDE-SIZE on a sample of SAMPLE's slots, LOOK and CONFIRM included:
the decision, the next state, and whether the workers were looked at."
  (let* ((looked nil)
         (look (getf sample :look))
         (sample (apply #'gallop.core::make-sizing-sample
                        :look (lambda (limit) (setf looked t) (funcall look limit))
                        (loop for (key value) on sample by #'cddr
                              unless (eq key :look) append (list key value)))))
    (multiple-value-bind (decision next) (gallop.core::decide-size sample state)
      (values decision next looked))))

(defun busy-sample (&key (blocked 0) (above-share 0) (room t))
  "A group of share 2, every worker busy, the process at half its CPUs,
whose look finds BLOCKED workers blocked (all confirmed)."
  (list :idle 0 :holders (+ 2 above-share) :allowed (+ 2 above-share)
        :threads (+ 2 above-share) :share 2 :load 0.5
        :room-for-permit room :room-for-thread room
        :look (lambda (limit) (values (min blocked limit) nil))
        :confirm (lambda (blocked) blocked)))

(test sizing-grows-after-two-blocked-samples
  "Enough workers blocked in two samples in a row: a permit and a thread,
then one a sample while that lasts; one sample not blocked starts over."
  (let ((state (gallop.core::make-sizing-state)))
    (flet ((next (&rest sample)
             (multiple-value-bind (decision next) (apply #'decide state sample)
               (setf state next)
               decision)))
      (is (eq :hold (apply #'next (busy-sample :blocked 2))))
      (is (eq :add-permit (apply #'next (busy-sample :blocked 2))))
      (is (eq :add-permit (apply #'next (busy-sample :blocked 2))))
      (is (eq :hold (apply #'next (busy-sample :blocked 0))))
      (is (eq :hold (apply #'next (busy-sample :blocked 2))))
      (is (eq :add-permit (apply #'next (busy-sample :blocked 2))))
      ;; A permit no thread holds (a thread left idle): a thread, no permit.
      (is (eq :add-thread (apply #'next (append '(:threads 1) (busy-sample :blocked 2)))))
      ;; No room left in the pool: nothing.
      (is (eq :hold (apply #'next (busy-sample :blocked 2 :room nil)))))))

(test sizing-holds-while-a-worker-is-idle-or-the-cpus-are-busy
  "No look and no growth while a worker of the group is idle or the
process uses over +GROWTH-CPU-LIMIT+ of its CPUs; a look that finds the
CPUs taken (saturated), or blocked workers not confirmed, grows nothing."
  (let ((state (gallop.core::make-sizing-state)))
    (dotimes (i 3)
      (multiple-value-bind (decision next looked)
          (apply #'decide state (append '(:idle 1) (busy-sample :blocked 2)))
        (is (eq :hold decision))
        (is (not looked))
        (setf state next))
      (multiple-value-bind (decision next looked)
          (apply #'decide state (append (list :load 0.9) (busy-sample :blocked 2)))
        (is (eq :hold decision))
        (is (not looked))
        (setf state next)))
    (dotimes (i 3)
      (multiple-value-bind (decision next)
          (apply #'decide state (append (list :look (lambda (limit) (declare (ignore limit)) (values 0 t)))
                                        (busy-sample)))
        (is (eq :hold decision))
        (setf state next)))
    ;; Blocked workers not confirmed, sample after sample: never blocked.
    (dotimes (i 3)
      (multiple-value-bind (decision next)
          (apply #'decide state (append (list :confirm (constantly 0)) (busy-sample :blocked 2)))
        (is (eq :hold decision))
        (is (zerop (gallop.core::sizing-blocked-samples next)))
        (setf state next)))))

(test sizing-with-idle-cpus-one-blocked-worker-is-enough
  "With the CPUs idle lately, one blocked holder grows the group; else more
than the holders minus the share (or half of them) must be blocked."
  (dolist (case '((nil 1 :hold) (t 1 :add-permit) (nil 4 :hold) (nil 5 :add-permit)))
    (destructuring-bind (cpus-idle blocked expected) case
      (let ((state (gallop.core::make-sizing-state)) (decision nil))
        (dotimes (i 2)
          (setf (values decision state)
                (apply #'decide state (append (list :cpus-idle cpus-idle)
                                              (busy-sample :blocked blocked :above-share 6)))))
        (is (eq expected decision) "CPUs idle ~S, ~D of 8 blocked: ~S" cpus-idle blocked decision)))))

(test sizing-looks-at-a-group-whose-workers-never-block-are-spaced
  "The workers are looked at every sample until +QUIET-LOOKS-BEFORE-SPACING+
looks in a row found too few blocked, then one sample in
+SPACED-LOOK-SAMPLES+; a look that finds enough goes back to every sample,
so that the next can confirm it."
  (let* ((state (gallop.core::make-sizing-state))
         (quiet gallop.core::+quiet-looks-before-spacing+)
         (spacing gallop.core::+spaced-look-samples+)
         (spaced (append (make-list (1- spacing) :initial-element nil) (list t))))
    (flet ((samples (n blocked)
             (loop repeat n
                   collect (multiple-value-bind (decision next looked)
                               (apply #'decide state (busy-sample :blocked (if blocked 2 0)
                                                                  :room nil :above-share 1))
                             (declare (ignore decision))
                             (setf state next)
                             looked))))
      (is (> spacing 1))
      (is (every #'identity (samples quiet nil)) "every sample looks at first")
      (is (equal (append spaced spaced) (samples (* 2 spacing) nil))
          "then one sample in +SPACED-LOOK-SAMPLES+")
      (setf state (gallop.core::make-sizing-state :quiet-looks quiet :look-in (1- spacing)))
      (flet ((grow-samples (n)
               (loop repeat n
                     collect (multiple-value-bind (decision next looked)
                                 (apply #'decide state (busy-sample :blocked 2))
                               (declare (ignore decision))
                               (setf state next)
                               looked))))
        (is (equal spaced (grow-samples spacing)) "until a look finds workers blocked")
        (is (every #'identity (grow-samples 3)) "then every sample looks again"))
      (is (every #'identity (samples quiet nil))
          "and goes on doing so for as many quiet looks as at first")
      (is (equal spaced (samples spacing nil))))))

(test sizing-gives-back-permits-that-cover-no-blocked-worker
  "Permits above the share are for blocked workers: after
+SPARE-LOOKS-BEFORE-SHRINK+ looks in a row found fewer blocked than half of
them, one goes back; a look that finds as many starts the count again.  A
second with an idle worker, or the CPUs over +SHRINK-CPU-LIMIT+, also
gives one back; none goes below the share."
  (let ((needed gallop.core::+spare-looks-before-shrink+))
    (flet ((first-back (blocked above-share &optional (state (gallop.core::make-sizing-state)))
             ;; The look (counted from 1) at which a permit goes back, or NIL.
             (loop for look from 1 to (* 2 needed)
                   do (loop repeat (* 2 gallop.core::+spaced-look-samples+)
                            do (multiple-value-bind (decision next looked)
                                   (apply #'decide state (busy-sample :blocked blocked :room nil
                                                                      :above-share above-share))
                                 (setf state next)
                                 (when (eq decision :remove-permit)
                                   (return-from first-back look))
                                 (when looked (return)))))))
      (is (> needed 1))
      (is (eql needed (first-back 0 2)))
      (is (eql needed (first-back 1 3)) "1 blocked is fewer than half of 3")
      (is (null (first-back 1 2)) "1 blocked covers half of 2: they stay")
      (is (null (first-back 0 0)) "none above the share: nothing to give back")
      (is (eql 1 (first-back 0 4 (gallop.core::make-sizing-state :spare-looks (1- needed)))))
      (is (null (first-back 3 4 (gallop.core::make-sizing-state :spare-looks (1- needed))))
          "a look that finds enough starts the count again"))
    (is (eq :remove-permit
            (apply #'decide (gallop.core::make-sizing-state)
                   (append (list :idle 1 :idle-samples (1+ gallop.core::+idle-samples-before-shrink+))
                           (busy-sample :above-share 1)))))
    (is (eq :hold (apply #'decide (gallop.core::make-sizing-state)
                         (append (list :idle 1 :idle-samples gallop.core::+idle-samples-before-shrink+)
                                 (busy-sample :above-share 1)))))
    (is (eq :remove-permit (apply #'decide (gallop.core::make-sizing-state)
                                  (append (list :load 0.96) (busy-sample :above-share 1)))))
    (is (eq :hold (apply #'decide (gallop.core::make-sizing-state)
                         (append (list :load 0.96 :idle 1 :idle-samples 1000) (busy-sample)))))))

;;; Recorded samples

(defun sizing-trace (scenario)
  "The samples bench/record-sizing.lisp recorded for SCENARIO."
  (with-open-file (in (merge-pathnames (format nil "tests/data/sizing/~A.sexp" scenario)
                                       (asdf:system-source-directory "gallop")))
    (let ((*read-eval* nil))
      (loop for line = (read in nil) while line collect line))))

(defun replay-sizing (scenario)
  "Replay SCENARIO's samples through DECIDE-SIZE, group by group, each from
the state the last decision left: every decision and state must be the one
recorded, and the look taken exactly where it was.  The decisions, in order."
  (let ((states (make-hash-table)) (decisions '()) (mismatches 0))
    (dolist (record (sizing-trace scenario))
      (destructuring-bind (group idle holders allowed threads share idle-samples load cpus-idle
                           room-for-permit room-for-thread limit blocked saturated
                           to-confirm confirmed (blocked-samples quiet-looks look-in spare-looks)
                           decision)
          record
        (let* ((before (gallop.core::make-sizing-state
                        :blocked-samples blocked-samples :quiet-looks quiet-looks
                        :look-in look-in :spare-looks spare-looks))
               (state (gethash group states before))
               (looked nil) (confirmed-asked nil)
               (sample (gallop.core::make-sizing-sample
                        :idle idle :holders holders :allowed allowed :threads threads
                        :share share :idle-samples idle-samples :load load :cpus-idle cpus-idle
                        :room-for-permit room-for-permit :room-for-thread room-for-thread
                        ;; Asked what the pool was asked, or the replay differs.
                        :look (lambda (asked)
                                (setf looked (eql asked limit))
                                (values (or blocked 0) saturated))
                        :confirm (lambda (n)
                                   (setf confirmed-asked (eql n to-confirm))
                                   (or confirmed 0)))))
          (unless (equalp state before)
            (incf mismatches))
          (multiple-value-bind (got next) (gallop.core::decide-size sample state)
            (unless (and (eq got decision) (eq looked (and limit t))
                         (eq confirmed-asked (and to-confirm t)))
              (incf mismatches))
            (setf (gethash group states) next)
            (push got decisions)))))
    (is (zerop mismatches) "~A: ~D samples differ from the recording" scenario mismatches)
    (nreverse decisions)))

(test sizing-replays-beside-a-cpu-hog
  "Recorded beside a busy loop on one CPU, handlers that never block: the
group never grows."
  (let ((decisions (replay-sizing "cpu-hog")))
    (is (> (length decisions) 400))
    (is (notany (lambda (d) (member d '(:add-permit :add-thread))) decisions))))

(test sizing-replays-blocked-handlers-then-idle
  "Recorded with handlers that sleep 1 ms, then none: the groups grow while
their workers block; once idle, a permit above the share goes back after
each +IDLE-SAMPLES-BEFORE-SHRINK+ samples with an idle worker, and only
then."
  (let ((decisions (replay-sizing "blocked"))
        (trace (sizing-trace "blocked")))
    (is (> (count :add-permit decisions) 10))
    (is (plusp (count :remove-permit decisions)))
    (loop for record in trace
          for decision in decisions
          when (eq decision :remove-permit)
            do (destructuring-bind (group idle holders allowed threads share idle-samples &rest rest)
                   record
                 (declare (ignore group holders threads rest))
                 (is (and (plusp idle) (> allowed share)
                          (> idle-samples gallop.core::+idle-samples-before-shrink+))
                     "a permit back at ~S" record)))))

(test sizing-replays-bursts
  "Recorded with four bursts of handlers that sleep 1 ms: growth in each
burst comes from the looks, and every decision replays."
  (let ((decisions (replay-sizing "bursts")))
    (is (> (count :add-permit decisions) 5))))
