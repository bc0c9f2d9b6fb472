;;;; profile.lisp -- the top of an sb-sprof profile of the native server under
;;;; wrk (doc/design.md, "Lisp frames in perf").
;;;;
;;;;   taskset -c 0 scripts/lisp.sh --load bench/profile.lisp
;;;;
;;;; Starts GALLOP:START on 127.0.0.1:18198 with the benchmark's /yo answer
;;;; (200, text/plain, "Hey!"), warms it up, then profiles every thread
;;;; (:CPU mode) while `wrk -t1 -c100 -d8s` runs on CPU 1 (run this process
;;;; on CPU 0, as above, so that the two do not share a core), and prints
;;;; wrk's rate and the top of the flat profile.  Needs wrk (scripts/deps.sh wrk).
;;;; sb-sprof samples a thread by signalling it, so time inside a system call
;;;; shows as that call's foreign function ("send", "recv"): the kernel's
;;;; work on the request.  `perf record` with bench/perf-map.lisp splits that
;;;; further.

(require :sb-sprof)
(asdf:load-system "gallop/native")

(defpackage #:gallop-profile (:use #:common-lisp))
(in-package #:gallop-profile)

(defun app (env)
  (if (string= (getf env :path-info) "/yo")
      (list 200 '(:content-type "text/plain") (list "Hey!"))
      (list 404 '(:content-type "text/plain") (list "Not Found"))))

(defun wrk (seconds)
  "Run wrk on CPU 1 against the server; its output."
  (with-output-to-string (out)
    (sb-ext:run-program "taskset" (list "-c" "1" "wrk" "-t1" "-c100"
                                        (format nil "-d~Ds" seconds)
                                        "http://127.0.0.1:18198/yo")
                        :search t :output out)))

(let ((server (gallop:start #'app :address "127.0.0.1" :port 18198)))
  (unwind-protect
       (progn
         (wrk 2)                        ; warm-up
         (sb-sprof:reset)
         (let ((output nil))
           (sb-sprof:with-profiling (:mode :cpu :threads :all :max-samples 400000
                                     :sample-interval 0.0002 :report nil)
             (setf output (wrk 8)))
           (let ((rate (search "Requests/sec" output)))
             (format t "~&~A~%" (if rate (subseq output rate (position #\Newline output :start rate)) output)))
           (sb-sprof:report :type :flat :max 50)))
    (gallop:stop server)))
(uiop:quit 0)
